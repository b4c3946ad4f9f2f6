"""``python -m cupy_rmsnorm.bench layer_norm --quick`` once on a GPU, at a tiny shape: every pass
and mode, each implementation that is installed checked against ours; the report written with
the commit it measured, and ``--replot`` reads it back."""

import json

from helpers import requires_torch_gpu

from cupy_rmsnorm.bench import cli, common, layer_norm

TINY = ["--quick", "--shapes", "64x1024", "--dtypes", "bf16", "--repeats", "2", "--no-chart"]


@requires_torch_gpu
def test_layer_norm(tmp_path, capsys):
    assert cli.main(["layer_norm", "--out", str(tmp_path)] + TINY) == 0
    payload = json.loads((tmp_path / "layer_norm.json").read_text())
    meta = payload["meta"]
    assert meta["command"] == "layer_norm" and meta["commit"] == common.git_state(common.library_root())[0]
    assert not payload["errors"], payload["errors"]
    results = payload["results"]
    assert [(r["op"], r["mode"]) for r in results] == [(op, m) for op in layer_norm.OPS for m in layer_norm.MODES]
    for r in results:
        assert r["us"]["ours"] > 0 and r["us"]["copy"] > 0, r
        assert all(err <= layer_norm.TOLERANCE for err in r["err"].values()), r
        ran = {i for i, us in r["us"].items() if us}
        assert {"ours", "copy"} | {i for i in layer_norm.PEERS if i not in payload["skipped"]
                                   and not layer_norm.unsupported(i, r["op"], r["dtype"])} == ran, r
    capsys.readouterr()
    assert cli.main(["layer_norm", "--replot", str(tmp_path / "layer_norm.json"), "--out", str(tmp_path / "re"),
                     "--no-chart"]) == 0
    assert (tmp_path / "re" / "layer_norm.md").read_text() == (tmp_path / "layer_norm.md").read_text()
