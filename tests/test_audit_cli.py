"""User-trial audit of ``python -m workbench train`` and the Hybrid recipe behind it: what a
user copies from README and ``--help`` either works as documented or is refused with
``error: ...`` (exit 2) naming the flag, its value and the fix; printed numbers agree with
the dry run where the dry run says it prints the line a real step prints."""
import pytest

from workbench.cli import main
from workbench.models.config import get_config
from workbench.plan.dryrun import dry_run
from workbench.plan.layout import Cluster, Layout
from workbench.recipes.hybrid import Hybrid
from workbench.train import train


def _modeled(**kw):
    return train("tiny", steps=1, seed=0, timing=False, strategy=Hybrid(**kw))[0]["modeled_ms"]


def test_1f1b_step_is_not_longer_than_gpipe_and_agrees_with_the_dry_run():
    """The pipeline executor sent a forward activation when the NEXT stage asked for it,
    ready at the sender's clock then: in 1F1B the sender had already run its next forward
    and a backward, so every send waited for them (tiny, pp 2, m 4: 0.415 ms against GPipe's
    0.306 and the dry run's 0.285).  A send leaves when its data was made."""
    f1b, gpipe = _modeled(pp=2), _modeled(pp=2, schedule="gpipe")
    assert f1b <= gpipe * 1.1
    dr = dry_run(get_config("tiny"), Layout(pp=2, micro_batch=2, global_batch=8),
                 Cluster("a100", 2))
    # the dry run composes the step from measured stages (plan/dryrun.py): within 10%
    assert f1b == pytest.approx(dr.step_time * 1e3, rel=0.1)


@pytest.mark.parametrize("flags,msg", [
    (["--ep-chunks", "2"], "--ep-chunks 2: the all-to-all it splits runs with expert "
                           "parallelism only; add --ep 2"),
    (["--ep-chunks", "0"], "--ep-chunks 0"),
    (["--schedule", "gpipe"], "--schedule gpipe with --pp 1"),
    (["--dp", "2", "--schedule", "zb-h1"], "add --pp 2 or leave --schedule out"),
    (["--dry-run", "--save", "ckpt"], "--save ckpt with --dry-run"),
    (["--dry-run", "--resume", "ckpt"], "--resume ckpt with --dry-run"),
    (["--dry-run", "--device", "cuda"], "--device cuda with --dry-run"),
    (["--dry-run", "--schedule", "gpipe"], "--schedule gpipe with --pp 1")])
def test_a_flag_the_run_would_ignore_is_refused(flags, msg, capsys):
    """These ran (exit 0) as if the flag were not there."""
    assert main(["train", "--preset", "tiny", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("auditcli") / "ckpt")
    assert main(["train", "--preset", "tiny", "--steps", "1", "--tp", "2", "--save", path]) == 0
    return path


@pytest.mark.parametrize("flags,msg", [
    (["--preset", "gpt-tiny"], "'pos_emb.weight' is not in the checkpoint"),
    (["--preset", "small"], "'tok_emb.weight' has shape (75, 384) here and (75, 64)"),
    (["--moe-experts", "4"], "'layers.0.mlp.router.weight' is not in the checkpoint"),
    (["--weight-decay", "0.1"], "saved with --weight-decay 0.01, this one has 0.1")])
def test_resume_of_another_run_is_refused_naming_the_flag(ckpt, flags, msg, capsys):
    """Another --preset or --moe-experts ended in a traceback (CheckpointError: 'pass
    strict=False', which the command has not); another --weight-decay in a ValueError
    traceback after the model was built."""
    args = ["train", "--steps", "2", "--resume", ckpt, *flags]
    assert main(args if "--preset" in flags else args + ["--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {ckpt}: ") and msg in err
    if "--weight-decay" not in flags:
        assert "--preset" in err


def test_train_resume_of_another_model_names_it(ckpt):
    with pytest.raises(ValueError, match=r"resume=.*'tok_emb.weight' has shape \(75, 384\)"):
        train("small", steps=2, timing=False, resume=ckpt)


def test_resume_on_another_layout_goes_on_with_the_same_losses(ckpt, capsys):
    one = [r["loss"] for r in train("tiny", steps=3, seed=0, timing=False)]
    assert main(["train", "--preset", "tiny", "--steps", "3", "--pp", "2", "--dp", "2",
                 "--resume", ckpt]) == 0
    import json
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in got] == [1, 2]
    assert [r["loss"] for r in got] == pytest.approx(one[1:], rel=1e-5)


@pytest.mark.parametrize("kw", [dict(dp=2), dict(tp=2, sp=True),
                                dict(tp=2, recompute="full")])
def test_a_steps_activation_bytes_are_the_dry_runs(kw):
    """The train record's activation_bytes (pp 1) counted a saved tensor whose lead dims a
    local kernel had flattened ((dp * B, S, h)) as if its first dims were ranks, and the
    broadcast copies the simulator makes of a weight as activations: dp 2 printed
    1,564,756 bytes where one rank keeps 2,854,938 (the dry run's, and one device's
    5,701,636 / 2).  Both now count with plan.meta_run.SavedCounter.  The tp 2 sp dry run
    crashed (cross-entropy's row offsets on meta, arange on the CPU)."""
    rc = kw.pop("recompute", "none")
    cfg = get_config("tiny", recompute=rc)
    rec = train(cfg, steps=1, seed=0, timing=False, strategy=Hybrid(**kw))[0]
    dr = dry_run(cfg, Layout(**kw, micro_batch=8 // kw.get("dp", 1), global_batch=8,
                             recompute=rc),
                 Cluster("a100", kw.get("dp", 1) * kw.get("tp", 1)))
    assert rec["activation_bytes"] == dr.memory["activations"]


def test_save_to_a_path_that_cannot_take_a_checkpoint_is_refused_before_training(tmp_path,
                                                                                capsys):
    """A file at --save's path: the run trained every step, then ended in FileExistsError."""
    f = tmp_path / "afile"
    f.write_text("x")
    for path in (f, f / "sub"):
        assert main(["train", "--preset", "tiny", "--steps", "1", "--save", str(path)]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith(f"error: --save {path}: ")
        with pytest.raises(ValueError, match="train.save="):
            train("tiny", steps=1, timing=False, save=str(path))
