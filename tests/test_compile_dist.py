"""wb.compile on the real engine: a compiled program runs on torch.distributed (gloo, one
process per rank, launched by torchrun) with eager's loss and gradients."""
import pytest

from tests.torchrun_support import four_proc, json_rows


def test_compiled_tiny_llama_on_four_gloo_processes_gives_eagers_loss_and_grads(
        tmp_path_factory):
    # one launch: every 4-process part (torchrun_support.FOUR_PROC)
    out, text = four_proc(tmp_path_factory, "compile_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert r["O2"] == pytest.approx(r["eager"], rel=1e-6)
        assert r["O2_grad_diff"] < 1e-6
