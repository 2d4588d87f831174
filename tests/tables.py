"""Table texts the tests share."""

TWO_RANKS = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 2
      dcp: 1
      rows:
        1-2: {ctas: 4, enabled: true}
        3: {ctas: 4, enabled: false}
        4: {ctas: 8, enabled: true}
"""
