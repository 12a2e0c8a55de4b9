"""A mistyped flag of any `stacx` command is refused with the closest real flags, like a mistyped YAML key."""

from __future__ import annotations

import pytest

from stacx.launch.cli import main


@pytest.mark.parametrize("argv, suggestion", [
    (["train", "--num-step", "3"], "--num-step: did you mean --num-steps or --num-epochs"),
    (["train", "--lrr=1e-4"], "--lrr: did you mean --lr"),
    (["eval", "--hf-chekpoint", "ckpt"], "--hf-chekpoint: did you mean --hf-checkpoint?"),
    (["recipes", "--markdow"], "--markdow: did you mean --markdown?"),
])
def test_a_mistyped_flag_gets_did_you_mean(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"stacx {argv[0]}: error: unrecognized arguments:" in err and suggestion in err


def test_a_flag_with_no_close_match_is_still_refused_without_a_guess(capsys):
    with pytest.raises(SystemExit):
        main(["recipes", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err
