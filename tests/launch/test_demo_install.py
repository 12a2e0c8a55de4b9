"""`make demo` installs only what the demo runs, and its last lines say how to reach `stacx`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stacx.launch.commands import demo as demo_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A meta-path finder that refuses the test extra's packages: the demo must run without them.
BLOCK_TEST_EXTRA = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'pytest', 'trl', 'diffusers'}:
            raise ImportError(f'{name} belongs to the test extra')
sys.meta_path.insert(0, Refuse())
import stacx.launch.demo.pipeline, stacx.trainer.factory, stacx.trainer.spmd, stacx.launch.commands.serve
import stacx.rollout.engines.cpu, stacx.launch.cli
print('imported')
"""


@pytest.mark.slow
def test_the_demo_imports_nothing_from_the_test_extra():
    completed = subprocess.run([sys.executable, "-c", BLOCK_TEST_EXTRA], capture_output=True, text=True,
                               timeout=120, cwd=REPO)
    assert completed.returncode == 0 and "imported" in completed.stdout, completed.stderr[-2000:]


def test_make_demo_installs_stacx_without_the_test_extra():
    with open(os.path.join(REPO, "Makefile")) as handle:
        makefile = handle.read()
    venv_rule = makefile.split("\nvenv:\n", 1)[1].split("\n\n", 1)[0]
    assert venv_rule.strip() == "bash scripts/setup_venv.sh"
    assert "\ndemo: venv\n" in makefile and "\ntest: venv-test\n" in makefile
    with open(os.path.join(REPO, "scripts", "setup_venv.sh")) as handle:
        script = handle.read()
    assert 'pip install -q -e .\n' in script


def test_the_demo_ends_by_saying_how_to_reach_stacx(monkeypatch):
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "prefix", os.path.join(os.getcwd(), ".venv"))
    hint = demo_command.next_steps_hint()
    assert "source .venv/bin/activate" in hint and "stacx recipes" in hint
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    assert "activate" not in demo_command.next_steps_hint()


def test_the_diffusion_demo_names_its_missing_extra(monkeypatch):
    real_find_spec = demo_command.importlib.util.find_spec
    monkeypatch.setattr(demo_command.importlib.util, "find_spec",
                        lambda name, *a: None if name == "diffusers" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[diffusion\]'"):
        demo_command.require_diffusers()
