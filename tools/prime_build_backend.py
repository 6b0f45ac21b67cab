"""PEP 517/660 build backend of prime-diloco: setuptools' own, plus a torch pin for isolated builds.

prime._C is compiled against torch's C++ API and only loads into the exact torch it was
built with. With `--no-build-isolation` (what the README and the Makefile use) the build
imports the torch already installed and this module adds nothing. In an isolated build
(plain `pip install .`) pip installs the build requirements into a throw-away
environment; asking there for an unpinned `torch` would build against whatever release
is newest (several GB) and give an extension that fails to load next to the user's
torch. So the requirement names the exact torch of the environment being installed
into, found by running its interpreter outside pip's isolation.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from setuptools.build_meta import *  # noqa: F401,F403  (build_wheel, build_editable, build_sdist, ...)

_TARGET_TORCH = "import importlib.metadata as m; print(m.version('torch'))"


def _target_torch_version():
    """The torch version installed in the interpreter pip builds for, or None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    try:
        out = subprocess.run([sys.executable, "-c", _TARGET_TORCH], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    version = out.stdout.strip()
    return version if out.returncode == 0 and version else None


def _torch_requirement():
    if importlib.util.find_spec("torch") is not None:  # not isolated: setup.py uses this torch
        return []
    version = _target_torch_version()
    if version is None:
        print("prime: isolated build and no torch installed yet: building against the newest torch; "
              "install torch first and pass --no-build-isolation to choose it", file=sys.stderr)
        return ["torch>=2.6"]
    print(f"prime: isolated build: asking for torch=={version}, the torch installed here (pass "
          "--no-build-isolation to build against it directly without a second copy)", file=sys.stderr)
    return [f"torch=={version}"]


# setuptools' own get_requires_* run setup.py, which needs torch already: answer without it.
# wheel: setuptools before 70.1 needs it for bdist_wheel.
def get_requires_for_build_wheel(config_settings=None):
    return ["wheel"] + _torch_requirement()


def get_requires_for_build_editable(config_settings=None):
    return ["wheel"] + _torch_requirement()


def get_requires_for_build_sdist(config_settings=None):
    return _torch_requirement()  # setup.py imports torch to describe the extension, even for a source archive
