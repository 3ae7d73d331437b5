"""``python -m workbench serve``: the text one device generates, on every layout; greedy
and seeded sampling; bad flags are one clear line and exit status 2."""
import pytest
import torch

import workbench as wb
from workbench.cli import main
from workbench.models.data import TOKENIZER
from workbench.serve import generate

PROMPT = "The fox"


def one_device(n, seed=0, **kw):
    m = wb.models.build_model("tiny", seed=seed).eval()
    g = torch.Generator().manual_seed(kw.pop("draw_seed", 0))
    out = generate(m, TOKENIZER.encode(PROMPT)[None], n, generator=g, **kw)
    return TOKENIZER.decode(out[0])


def serve(capsys, *flags):
    rc = main(["serve", "--preset", "tiny", "--prompt", PROMPT, *flags])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("layout", [[], ["--tp", "2"], ["--dp", "2", "--tp", "2"]])
def test_serve_prints_one_devices_text_on_every_layout(capsys, layout):
    rc, out, err = serve(capsys, "--max-new-tokens", "12", *layout)
    assert rc == 0, err
    assert out == one_device(12) + "\n"
    rc, out, err = serve(capsys, "--max-new-tokens", "12", "--temperature", "0.9",
                         "--top-k", "20", "--top-p", "0.95", "--seed", "3", *layout)
    assert rc == 0, err
    # --seed seeds the draws, and the init of an untrained --preset
    assert out == one_device(12, seed=3, temperature=0.9, top_k=20, top_p=0.95, draw_seed=3) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "5"], "--temperature"),
    (["--tp", "3"], "tp does not divide n_head=4"),
    (["--tp", "0"], "--tp 0"),
    (["--max-new-tokens", "80"], "seq_len=64"),
    (["--checkpoint", "/nonexistent/ckpt"], "no such folder"),
])
def test_bad_flags_are_one_clear_line(capsys, flags, message):
    rc, out, err = serve(capsys, *flags)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_prompt_outside_the_alphabet_is_named(capsys):
    rc = main(["serve", "--prompt", "café", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "'é'" in err


def test_only_presets_over_the_alphabet_are_served(capsys):
    from workbench.serve.cli import servable_presets
    assert servable_presets() == ["tiny", "small", "gpt-tiny"]
    with pytest.raises(SystemExit):                     # argparse: an invalid choice
        main(["serve", "--preset", "llama2-7b", "--prompt", PROMPT])
    assert "invalid choice: 'llama2-7b'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of 2 training steps on dp 2 x tp 2 (``train --save``)."""
    from workbench.recipes.hybrid import Hybrid
    from workbench.train import train
    ckpt = str(tmp_path_factory.mktemp("serve") / "dp2-tp2")
    train("tiny", steps=2, seed=0, timing=False, strategy=Hybrid(dp=2, tp=2), save=ckpt)
    return ckpt


def test_a_checkpoint_trained_on_one_layout_serves_one_devices_text_on_another(capsys, trained):
    m = wb.models.build_model("tiny", seed=7).eval()         # any init: the checkpoint fills it
    sd = m.state_dict()
    wb.checkpoint.load(trained, {"model": sd})
    m.load_state_dict(sd)
    want = TOKENIZER.decode(generate(m, TOKENIZER.encode(PROMPT)[None], 12)[0]) + "\n"
    assert want != one_device(12) + "\n"                    # the trained weights tell
    for layout in ([], ["--tp", "2"]):
        rc, out, err = serve(capsys, "--checkpoint", trained, "--max-new-tokens", "12", *layout)
        assert rc == 0, err
        assert out == want


def test_a_damaged_checkpoint_is_named(capsys, trained, tmp_path):
    import os
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(trained, bad)
    sd = wb.models.build_model("tiny").state_dict()
    read = sorted(wb.checkpoint.load(bad, {"model": sd}).files())      # what the model reads
    path = os.path.join(bad, read[0])
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(data[: len(data) // 2]))              # truncated
    rc, out, err = serve(capsys, "--checkpoint", bad, "--max-new-tokens", "4")
    assert rc == 2 and out == "" and read[0] in err
