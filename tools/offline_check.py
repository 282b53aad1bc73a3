"""Can sana2 be installed here without a package index? Used by tools/bootstrap.sh in offline mode.

    python tools/offline_check.py ROOT [WHEELHOUSE]

Reads ROOT/pyproject.toml and checks each requirement that an offline install needs (the build
backend, every dependency, the test runner) against what this Python environment has installed and
the wheels in WHEELHOUSE. Prints pip's extra arguments on stdout (`--no-build-isolation` when the
build backend is installed, so pip does not look for it in an index; the test runner's requirements
where they can be had) and, on stderr, one line per requirement that neither has. Exit code 0 when
every dependency can be had (a missing test runner is only reported: sana2 runs without it), 3 when
some cannot.

Only the direct requirements are checked; a missing dependency of a dependency shows in pip's own
message. Needs Python 3.11+ (tomllib); versions are compared with `packaging` where it is installed
(it usually is), else only names.
"""

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # names only
    Requirement = None

TEST_RUNNER = ("pytest", "pytest-timeout")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> tuple[str, object]:
    """(normalised name, specifier or None) of a requirement string; environment markers are honoured
    where packaging is installed (a requirement whose marker is false here comes back as ("", None))."""
    if Requirement is None:
        return normalise(re.split(r"[\s\[<>=!~;]", text.strip(), maxsplit=1)[0]), None
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate():
        return "", None
    return normalise(requirement.name), requirement.specifier


def satisfies(version: str, specifier) -> bool:
    if specifier is None or not str(specifier):
        return True
    try:
        return specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def wheel_versions(folder: Path | None) -> dict[str, list[str]]:
    """{normalised name: [versions]} of the wheels in `folder` (name-version-...-tags.whl)."""
    found: dict[str, list[str]] = {}
    for wheel in sorted(folder.glob("*.whl")) if folder else ():
        name, version = wheel.name.split("-")[:2]
        found.setdefault(normalise(name), []).append(version)
    return found


def check(text: str, wheels: dict[str, list[str]]) -> tuple[str, str | None]:
    """(how it is had: "installed" / "wheel" / "", what is wrong if it is not had)."""
    name, specifier = parse(text)
    if not name:
        return "not needed here", None
    have = installed_version(name)
    if have is not None and satisfies(have, specifier):
        return "installed", None
    if any(satisfies(version, specifier) for version in wheels.get(name, ())):
        return "wheel", None
    if have is not None:
        return "", f"{text}: {have} is installed"
    offered = wheels.get(name)
    return "", f"{text}: not installed" + (f"; the wheelhouse has {', '.join(offered)}" if offered else "")


def main() -> int:
    root = Path(sys.argv[1])
    folder = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
    project = tomllib.loads((root / "pyproject.toml").read_text())
    wheels = wheel_versions(folder)
    where = f"no wheel for it in {folder}" if folder else "no wheelhouse (./wheelhouse or SANA2_WHEELHOUSE)"
    missing, pip_args = [], []
    for text in project["build-system"]["requires"]:
        how, problem = check(text, wheels)
        if problem:
            missing.append(f"{problem} (sana2's build backend)")
        elif how == "installed":
            pip_args.append("--no-build-isolation")  # build with it: an isolated build would ask an index
    for text in project["project"]["dependencies"]:
        problem = check(text, wheels)[1]
        if problem:
            missing.append(problem)
    for text in project["project"]["optional-dependencies"]["test"]:
        if parse(text)[0] in TEST_RUNNER:
            problem = check(text, wheels)[1]
            if problem:
                print(f"[bootstrap] {problem}, and {where}: ./run_tests.sh will not run", file=sys.stderr)
            else:
                pip_args.append(text)
    for problem in missing:
        print(f"[bootstrap] missing: {problem}, and {where}", file=sys.stderr)
    if missing:
        print(
            "[bootstrap] sana2 cannot be installed offline. On a machine with registry access run "
            "tools/wheelhouse.sh and bring its folder here as ./wheelhouse (or set SANA2_WHEELHOUSE to it)",
            file=sys.stderr,
        )
        return 3
    print(" ".join(dict.fromkeys(pip_args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
