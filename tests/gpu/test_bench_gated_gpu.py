"""``python -m cupy_rmsnorm.bench gated`` once on a GPU, at its smallest: every pass and mode of a
Gated DeltaNet case and of grouped whole rows in both orders, each implementation checked against
ours; the report written with the commit it measured, and ``--replot`` reads it back."""

import json

from helpers import requires_torch_gpu

from cupy_rmsnorm.bench import cli, common, gated

TINY = ["--heads", "64x4", "--shapes", "64x2048", "--group-sizes", "none,512", "--orders", "norm-gate,gate-norm",
        "--dtypes", "bf16", "--repeats", "2", "--no-chart"]


@requires_torch_gpu
def test_gated(tmp_path, capsys):
    assert cli.main(["gated", "--out", str(tmp_path)] + TINY) == 0
    payload = json.loads((tmp_path / "gated.json").read_text())
    meta = payload["meta"]
    assert meta["command"] == "gated" and meta["commit"] == common.git_state(common.library_root())[0]
    assert not payload["errors"], payload["errors"]
    results = payload["results"]
    assert len(results) == (2 + 2 * 2) * 3 * 2          # cases x passes x modes
    for r in results:
        assert r["us"]["ours"] > 0 and r["us"]["ours_cupy"] > 0 and r["us"]["copy"] > 0, r
        assert all(err <= gated.TOLERANCE for err in r["err"].values()), r
        ran = {i for i, us in r["us"].items() if us}
        assert {"ours", "ours_cupy", "copy"} | {i for i in gated.PEERS if i not in payload["skipped"]
                                               and not gated.unsupported(i, gated.case_of(r))} == ran, r
    capsys.readouterr()
    assert cli.main(["gated", "--replot", str(tmp_path / "gated.json"), "--out", str(tmp_path / "re"),
                     "--no-chart"]) == 0
    assert (tmp_path / "re" / "gated.md").read_text() == (tmp_path / "gated.md").read_text()
