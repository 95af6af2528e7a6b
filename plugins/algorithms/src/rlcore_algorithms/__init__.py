"""rlcore-algorithms: the algorithm zoo beyond core's grpo, dr_grpo, rloo and ppo, registered
through rlcore's ``algorithm`` hook (``plugins: [algorithms]``, then ``algorithm.name: gspo``).

Public modules, for a plugin that reuses an estimator or a loss of this one: :mod:`.advantages`
(REINFORCE++, GDPO, ReMax), :mod:`.baselines` (OPO, pass@k, GPG), :mod:`.token_baseline` (the
optimal-token baseline), :mod:`.losses` (GSPO, CISPO), :mod:`.surrogates` (SAPO, GPG, Clip-Cov,
KL-Cov, GMPO, DPPO, DRO)."""

__version__ = "0.1.0"

__all__ = ["advantages", "baselines", "losses", "surrogates", "token_baseline"]
