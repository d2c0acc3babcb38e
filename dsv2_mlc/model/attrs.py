"""Names of the IR attributes the model sets on what it exports, for the passes to read."""

from __future__ import annotations

# Relax function attribute naming what an entry point runs ("prefill", "extend" or "decode"), set
# by the model when it is exported (``DeepseekV2ForCausalLM.annotate_entries``).
ENTRY_KIND_ATTR = "dsv2_mlc.entry_kind"
