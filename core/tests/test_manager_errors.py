"""Every plugin-loading and selection error, with its message asserted (the text is the UX)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

from rlcore import errors
from rlcore.discovery import KNOWN_DISTRIBUTIONS, first_party_plugin_of, install_hint
from rlcore.hookspecs import PROVIDER_HOOKS
from rlcore.manager import PluginManager
from rlcore.stack import load_config, resolve

GOOD = """
from rlcore import PLUGIN_API, hookimpl
from rlcore.types import ForwardFnSpec
@hookimpl
def forward_fn():
    yield ForwardFnSpec(name="{provider}", factory=lambda ctx: None)
"""


@pytest.fixture
def not_installed(monkeypatch):
    """``not_installed(*names)``: entry-point discovery no longer sees plugins ``names``, as on a
    machine where their distributions were never installed."""
    import rlcore.manager

    def hide(*names):
        real = rlcore.manager.discover_entry_points

        def discover():
            return {n: eps for n, eps in real().items() if n not in names}

        monkeypatch.setattr(rlcore.manager, "discover_entry_points", discover)

    return hide


def test_selected_plugin_not_installed_names_pip_line_and_lists_installed(not_installed):
    not_installed("megatron")
    pm = PluginManager()
    with pytest.raises(errors.PluginNotInstalledError) as e:
        pm.activate(["megatron"])
    msg = str(e.value)
    assert "Plugin 'megatron' is not installed" in msg
    assert "pip install rlcore-megatron" in msg
    assert "Installed rlcore plugins:" in msg and "reference" in msg


def test_megatron_engine_not_installed_hints_its_distribution(not_installed):
    """``engine: {name: megatron}`` without the engine: the hint is the real install line."""
    not_installed("megatron")
    cfg, pm = load_config(None, ["engine.name=megatron"])
    with pytest.raises(errors.UnknownProviderError) as e:
        resolve(cfg, pm)
    msg = str(e.value)
    assert "engine.name: 'megatron' is not a known engine. Choose one of: hf." in msg
    assert "comes with the plugin 'megatron', which is not installed" in msg
    assert "pip install rlcore-megatron, and add megatron to the config's plugins: list" in msg


def test_installed_but_inactive_first_party_provider_says_add_it_to_plugins():
    cfg, pm = load_config(None, ["forward.name=fused"])  # rlcore-fused is installed in the test venv
    with pytest.raises(errors.UnknownProviderError) as e:
        resolve(cfg, pm)
    msg = str(e.value)
    assert "comes with the plugin 'fused' (rlcore-fused " in msg
    assert "installed but not active: add fused to the config's plugins: list" in msg and "pip install" not in msg


def test_misspelled_inactive_first_party_provider_gets_did_you_mean_and_the_plugin():
    cfg, pm = load_config(None, ["forward.name=fusd"])
    with pytest.raises(errors.UnknownProviderError) as e:
        resolve(cfg, pm)
    msg = str(e.value)
    assert "Choose one of: reference. Did you mean 'fused'? It comes with the plugin 'fused' (rlcore-fused " in msg


def test_misspelled_plugin_in_config_gets_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text("plugins: [fsued]\n")
    with pytest.raises(errors.PluginNotInstalledError) as e:
        load_config(path)
    msg = str(e.value)
    assert "Plugin 'fsued' is not installed. Did you mean 'fused'?" in msg
    assert "(the name comes from the config's plugins: list)" in msg


def test_misspelled_plugin_in_env_gets_did_you_mean_and_names_the_variable(monkeypatch):
    monkeypatch.setenv("RLCORE_PLUGINS", "vllm,sglnag")
    with pytest.raises(errors.PluginNotInstalledError) as e:
        load_config(None)
    msg = str(e.value)
    assert "Plugin 'sglnag' is not installed. Did you mean 'sglang'?" in msg
    assert "(the name comes from RLCORE_PLUGINS=vllm,sglnag)" in msg


def test_misspelled_provider_name_gets_did_you_mean(rlcore_plugin_manager):
    with pytest.raises(errors.UnknownProviderError) as e:
        rlcore_plugin_manager.select("weight_sync", "inprc", key="sync.name")
    assert "sync.name: 'inprc' is not a known weight_sync. Choose one of: disk, inproc. Did you mean 'inproc'?" in str(e.value)


# ---- install hints name only distributions that exist --------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _repo_distributions() -> dict[str, set[str]]:
    """Distribution name -> its extras, from core/pyproject.toml and plugins/*/pyproject.toml."""
    out = {}
    for path in [ROOT / "core" / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text())["project"]
        out[project["name"]] = set(project.get("optional-dependencies", {}))
    return out


def _pip_install_hints() -> set[tuple[str, str, str]]:
    """``(file:line, distribution, extra)`` for every ``pip install rlcore...`` in an error
    message (a string in core's or a plugin's source)."""
    found = set()
    sources = [*ROOT.glob("core/src/**/*.py"), *ROOT.glob("plugins/*/src/**/*.py")]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            for m in re.finditer(r"pip install ([^{}]*)", text):
                for word in m.group(1).split():
                    dist = re.match(r"['\"`]?(rlcore[a-z0-9_-]*)(?:\[([a-z0-9_,-]+)\])?", word)
                    if dist:
                        found.add((f"{path.relative_to(ROOT)}:{node.lineno}", dist.group(1), dist.group(2) or ""))
    return found


def test_pip_install_hints_are_found():
    # the scan itself works: the fused plugin's Triton hint and the hint table's f-string
    hints = _pip_install_hints()
    assert any(d == "rlcore-fused" and extra == "triton" for _, d, extra in hints), hints


@pytest.mark.parametrize("plugin", sorted(KNOWN_DISTRIBUTIONS))
def test_every_hinted_first_party_distribution_is_in_this_repository(plugin):
    dist = KNOWN_DISTRIBUTIONS[plugin]
    assert dist in _repo_distributions(), f"install hint names {dist!r}, which no pyproject.toml here defines"
    assert install_hint(plugin) == f"pip install {dist}"


def test_every_pip_install_line_in_an_error_names_a_distribution_of_this_repository():
    dists = _repo_distributions()
    bad = [f"{where}: pip install {d}{f'[{x}]' if x else ''}" for where, d, x in sorted(_pip_install_hints())
           if d not in dists or (x and x not in dists[d])]
    assert not bad, "install hints naming distributions (or extras) that do not exist:\n" + "\n".join(bad)


def test_first_party_providers_are_named_after_their_plugin():
    # the rule first_party_plugin_of relies on, checked for every first-party plugin installed here
    records = {r.name: r for r in PluginManager().describe()}
    for plugin in KNOWN_DISTRIBUTIONS:
        rec = records.get(plugin)
        if rec is None or rec.status == "broken":
            continue
        for hook in PROVIDER_HOOKS:
            for provider in rec.provides.get(hook, []):
                assert first_party_plugin_of(provider) == plugin, (plugin, hook, provider)


def test_unknown_third_party_plugin_explains_entry_point():
    with pytest.raises(errors.PluginNotInstalledError, match=r"no known distribution provides it.*entry-points\.rlcore\] acme"):
        PluginManager().activate(["acme"])


def test_two_distributions_same_plugin_name(fake_distribution):
    fake_distribution("acme-heads", "1.2.0", {"dup": "acme_a"}, {"acme_a": GOOD.format(provider="a")})
    fake_distribution("other-heads", "3.4.5", {"dup": "acme_b"}, {"acme_b": GOOD.format(provider="b")})
    with pytest.raises(errors.PluginConflictError) as e:
        PluginManager().activate(["dup"])
    assert "acme-heads 1.2.0" in str(e.value) and "other-heads 3.4.5" in str(e.value)


def test_two_distributions_same_provider_name(fake_distribution):
    fake_distribution("acme-heads", "1.2.0", {"acme": "acme_mod"}, {"acme_mod": GOOD.format(provider="fast")})
    fake_distribution("other-heads", "3.4.5", {"other": "other_mod"}, {"other_mod": GOOD.format(provider="fast")})
    with pytest.raises(errors.PluginConflictError) as e:
        PluginManager().activate(["acme", "other"])
    msg = str(e.value)
    assert "Conflicting plugins for forward_fn 'fast'" in msg
    assert "acme-heads 1.2.0" in msg and "other-heads 3.4.5" in msg


def test_plugin_import_failure_names_plugin_and_cause(fake_distribution):
    fake_distribution("broken-dist", "0.1", {"broken": "broken_mod"}, {"broken_mod": "import not_a_real_module_xyz\n"})
    with pytest.raises(errors.PluginImportError) as e:
        PluginManager().activate(["broken"])
    msg = str(e.value)
    assert "Plugin 'broken' (broken-dist 0.1) failed to import" in msg
    assert "ModuleNotFoundError" in msg and "not_a_real_module_xyz" in msg


def test_plugin_built_for_another_api_is_refused(fake_distribution):
    src = GOOD.format(provider="x").replace("from rlcore import PLUGIN_API, hookimpl", "from rlcore import hookimpl\nPLUGIN_API = 99")
    fake_distribution("future-dist", "9.0", {"future": "future_mod"}, {"future_mod": src})
    with pytest.raises(errors.PluginAPIError) as e:
        PluginManager().activate(["future"])
    msg = str(e.value)
    assert "built for rlcore plugin API 99" in msg and "speaks plugin API 1" in msg and "future-dist 9.0" in msg


def test_plugin_without_api_declaration_is_refused(rlcore_plugin_manager):
    import types

    mod = types.ModuleType("no_api")
    with pytest.raises(errors.PluginAPIError, match="does not declare PLUGIN_API"):
        rlcore_plugin_manager.register(mod, "no_api")


def _module(name, src):
    import textwrap
    import types

    mod = types.ModuleType(name)
    exec(textwrap.dedent(src), mod.__dict__)
    return mod


def test_implementation_with_argument_not_in_spec(rlcore_plugin_manager):
    mod = _module("extra_arg", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl
        def postprocess(ctx, output, learning_rate):
            return None
    """)
    with pytest.raises(errors.PluginValidationError) as e:
        rlcore_plugin_manager.register(mod, "extra_arg")
    msg = str(e.value)
    assert "Plugin 'extra_arg'" in msg and "learning_rate" in msg and "postprocess(ctx, output)" in msg


def test_hook_name_no_spec_defines(rlcore_plugin_manager):
    mod = _module("typo", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl
        def postprocesss(ctx, output):
            return None
    """)
    with pytest.raises(errors.PluginValidationError) as e:
        rlcore_plugin_manager.register(mod, "typo")
    msg = str(e.value)
    assert "implements hook 'postprocesss', which no rlcore hook spec defines" in msg
    assert "Did you mean 'postprocess'?" in msg


def test_chain_hook_must_not_reorder_itself(rlcore_plugin_manager):
    mod = _module("pushy", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl(tryfirst=True)
        def postprocess(ctx, output):
            return None
    """)
    with pytest.raises(errors.PluginValidationError, match="order of the config's plugins: list"):
        rlcore_plugin_manager.register(mod, "pushy")
    assert "pushy" not in rlcore_plugin_manager.active


def test_unknown_provider_name_lists_valid_ones(rlcore_plugin_manager):
    with pytest.raises(errors.UnknownProviderError) as e:
        rlcore_plugin_manager.select("forward_fn", "fusd", key="forward.name")
    assert "forward.name: 'fusd' is not a known forward_fn. Choose one of: reference" in str(e.value)


def test_known_first_party_provider_hints_the_plugin(rlcore_plugin_manager):
    with pytest.raises(errors.UnknownProviderError) as e:
        rlcore_plugin_manager.select("forward_fn", "fused", key="forward.name")
    assert "add it to plugins:" in str(e.value) and "pip install rlcore-fused" in str(e.value)


def test_declared_incompatibility_names_both_distributions(rlcore_plugin_manager, register_plugin, rlcore_config):
    a = _module("mtp_like", """
        from rlcore import PLUGIN_API, hookimpl
        from rlcore.types import IncompatibleWith
        @hookimpl
        def constraints():
            yield IncompatibleWith("fused_like", reason="both replace the output layer")
    """)
    b = _module("fused_like", "from rlcore import PLUGIN_API\n")
    register_plugin(a, "mtp_like", distribution="rlcore-mtplike", version="0.2")
    register_plugin(b, "fused_like", distribution="rlcore-fusedlike", version="0.3")
    with pytest.raises(errors.IncompatiblePluginsError) as e:
        resolve(rlcore_config(), rlcore_plugin_manager)
    msg = str(e.value)
    assert "Plugin 'mtp_like' (rlcore-mtplike 0.2) cannot be used together with plugin 'fused_like' (rlcore-fusedlike 0.3)" in msg
    assert "both replace the output layer" in msg


def test_declared_capability_requirement(rlcore_plugin_manager, register_plugin, rlcore_config):
    mod = _module("needs_sleep", """
        from rlcore import PLUGIN_API, hookimpl
        from rlcore.types import RequiresCapability
        @hookimpl
        def constraints():
            yield RequiresCapability("rollout_backend", "release_weights", reason="colocated offload",
                                     when=lambda cfg: cfg.rollout.n > 4)
    """)
    register_plugin(mod, "needs_sleep", distribution="acme", version="1")
    resolve(rlcore_config("rollout.n=2"), rlcore_plugin_manager)  # `when` is false: fine
    with pytest.raises(errors.MissingCapabilityError) as e:
        resolve(rlcore_config("rollout.n=8"), rlcore_plugin_manager)
    msg = str(e.value)
    assert "plugin 'needs_sleep' (acme 1) needs rollout_backend with capability 'release_weights'" in msg
    assert "'local' (rlcore" in msg


def test_env_selects_and_disables_plugins(monkeypatch):
    monkeypatch.setenv("RLCORE_PLUGINS", "example")
    assert PluginManager.requested_plugins(["fused"]) == ["example"]
    monkeypatch.setenv("RLCORE_PLUGINS", "")
    assert PluginManager.requested_plugins(["fused"]) == []
    monkeypatch.delenv("RLCORE_PLUGINS")
    monkeypatch.setenv("RLCORE_DISABLED_PLUGINS", "example")
    with pytest.raises(errors.PluginError, match="disabled by RLCORE_DISABLED_PLUGINS"):
        PluginManager().activate(["example"])
