"""Print the requirement pinning a dependency to the oldest release pyproject.toml allows
(`"redis>=6.0.0"` -> `redis==6.0.0`), so CI tests the floor the package promises."""

import re
import sys
from pathlib import Path

name = sys.argv[1]
pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
match = re.search(rf'^\s*"{re.escape(name)}>=([\w.]+)",?$', pyproject, re.M)
if match is None:
    sys.exit(f"no '{name}>=' requirement in pyproject.toml")
print(f"{name}=={match.group(1)}")
