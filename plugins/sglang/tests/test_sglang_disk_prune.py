"""sglang-disk keeps the newest ``keep`` versions of its directory. No SGLang needed."""

from rlcore_sglang.settings import SGLangSettings
from rlcore_sglang.sync import SGLangDiskSync


def test_disk_sync_keeps_the_newest_versions(tmp_path):
    sync = SGLangDiskSync(SGLangSettings(disk_dir=str(tmp_path)), bucket_bytes=600, keep=2)
    for name in ("v1", "v2", "v3", "v4", ".v5.partial", "vendor"):
        (tmp_path / name).mkdir()
    sync._prune(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v5.partial", "v3", "v4", "vendor"]
