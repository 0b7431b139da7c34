"""Print the requirement pinning a dependency to the oldest release pyproject.toml allows
(`redis>=6.4` -> `redis==6.4`), so CI tests the floor the package promises."""

import re
import sys
import tomllib
from pathlib import Path

name = sys.argv[1]
project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
for requirement in project["project"]["dependencies"]:
    match = re.fullmatch(rf"{re.escape(name)}>=([\w.]+)", requirement.replace(" ", ""))
    if match:
        print(f"{name}=={match.group(1)}")
        break
else:
    sys.exit(f"no '{name}>=' requirement in pyproject.toml")
