"""The GPU architectures the gather compiles for; plain Python. Before sm_90 the PTX
assembler rejects PDL's ``griddepcontrol``: there stream order alone sequences the calls.
"""

# Every target CI compiles and audits.
ARCHS = ("sm_80", "sm_90a", "sm_100a", "sm_103a")


def capability(arch: str) -> tuple:
    """``(major, minor)`` of a target name such as ``sm_90a`` or ``sm_80``."""
    digits = arch.removeprefix("sm_").rstrip("af")
    if not arch.startswith("sm_") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"not a GPU architecture name: {arch!r} (expected e.g. sm_90a)")
    return int(digits[:-1]), int(digits[-1])


def target(major: int, minor: int) -> str:
    """The compile target of compute capability ``major.minor`` (``a`` from Hopper on)."""
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def has_pdl(arch: str) -> bool:
    return capability(arch)[0] >= 9
