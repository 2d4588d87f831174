"""The GPU architectures the gather compiles for, and what each has. Plain Python
(no DSL import): the runtime asks it before anything is compiled.

One decision lives here: programmatic dependent launch (PDL: ``griddepcontrol``,
the early launch that overlaps a kernel's prologue with its predecessor's tail)
exists from Hopper (sm_90) on. Before it (A100 sm_80, Ada sm_89) the PTX assembler
rejects ``griddepcontrol``, so the gather compiles without PDL there and the stream
order alone keeps its calls in sequence.
"""

# Every target ``compile_gather`` is checked on (CI compiles and audits each): NVLink
# generations from A100 to B300; Hopper and later with their arch-specific features.
ARCHS = ("sm_80", "sm_90a", "sm_100a", "sm_103a")


def capability(arch: str) -> tuple:
    """``(major, minor)`` of a target name such as ``sm_90a`` or ``sm_80``."""
    digits = arch.removeprefix("sm_").rstrip("af")
    if not arch.startswith("sm_") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"not a GPU architecture name: {arch!r} (expected e.g. sm_90a)")
    return int(digits[:-1]), int(digits[-1])


def target(major: int, minor: int) -> str:
    """The compile target of a device of compute capability ``major.minor``: the
    arch-specific ``a`` variant from Hopper on, plain ``sm_XY`` before."""
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def has_pdl(arch: str) -> bool:
    """Whether ``arch`` has programmatic dependent launch (sm_90 and later)."""
    return capability(arch)[0] >= 9
