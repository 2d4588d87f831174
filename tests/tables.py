"""Table texts the tests share."""

# The same rows for each vocabulary V (= TP x shard width) the tests' models serve: a
# section is served only to a model of its V. 128: helpers.model's 64-row shard on 2
# ranks; 192: the same on 3 (tests write this text with "tp: 2" replaced by "tp: 3",
# which leaves three tp-3 sections of distinct V); 1024: the real vLLM and SGLang
# heads (V = 1000 padded to 1024 on 2 ranks).
_SECTION = """\
    - tp: 2
      dcp: 1
      vocab: {vocab}
      rows:
        1-2: {{ctas: 4, enabled: true}}
        3: {{ctas: 4, enabled: false}}
        4: {{ctas: 8, enabled: true}}
"""
TWO_RANKS_VOCABS = (128, 192, 1024)


def sections(vocabs, more_rows="", stock=None, fp32_vocabs=()):
    """A table of one such section per vocabulary, each with ``more_rows`` (YAML lines
    at the rows' indentation) after the shared ones; ``stock``: the stock each section
    was measured against (None: unwritten, NCCL's). The sections are BF16 (no ``dtype``
    written); ``fp32_vocabs``: the vocabularies that also get the same section for
    FP32 logits (``dtype: float32``: an FP32 lm_head's)."""
    text = "".join(_SECTION.format(vocab=v) + more_rows for v in vocabs)
    text += "".join(_SECTION.format(vocab=v).replace("      dcp: 1\n",
                                                     "      dcp: 1\n      dtype: float32\n")
                    + more_rows for v in fp32_vocabs)
    if stock is not None:
        text = text.replace("      dcp: 1\n", f"      dcp: 1\n      stock: {stock}\n")
    return "schema: 1\ndevices:\n  NVIDIA H200:\n" + text


TWO_RANKS = sections(TWO_RANKS_VOCABS)
