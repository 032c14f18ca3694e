"""common-expression-language and xds-protos both install a top-level package ``cel``: the first brings
the CEL engine (a Rust extension, ``cel.cel``, re-exported by its ``cel/__init__.py``), the second Google's
``cel.expr`` protos with an empty ``cel/__init__.py``. Whichever pip installs last writes that file, so
splitserve's CEL checks must not depend on it: they import the extension module itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import cel.cel


def test_cel_checks_work_when_xds_protos_wrote_cel_init_last(tmp_path: Path) -> None:
    real = Path(cel.cel.__file__)
    clashed = tmp_path / "cel"
    clashed.mkdir()
    (clashed / "__init__.py").write_text("")  # what xds-protos installs
    shutil.copy(real, clashed / real.name)
    (clashed / "expr").mkdir()
    (clashed / "expr" / "__init__.py").write_text("")
    probe = (
        "import cel, splitserve.validation.checker as c\n"
        "assert not hasattr(cel, 'evaluate'), 'the clash was not reproduced'\n"
        "print(c.cel_evaluate('self.a > 1', {'self': {'a': 2}}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n{probe}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
