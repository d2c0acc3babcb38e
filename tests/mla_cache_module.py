"""An nn module whose ``create_paged_kv_cache`` builds an ``MLAPagedKVCache``, for the cache tests.

:class:`MLACacheModule` has V2-Lite's attention shapes by default (2 layers, 16 heads, latent 512,
nope 128, rope 64, v 128, fp16); :func:`create_script` exports ``create_paged_kv_cache`` alone
and returns what it put into the module.
"""

from __future__ import annotations

import tvm
from tvm.relax.frontend import nn

from dsv2_mlc.model.kv_cache import MLAPagedKVCache


def create_spec() -> dict:
    """The export spec of ``create_paged_kv_cache`` (integer arguments, no params or effects)."""
    names = ["max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size"]
    return {
        "create_paged_kv_cache": {
            **{k: int for k in names},
            "support_sliding": int,
            "$": {"param_mode": "none", "effect_mode": "none"},
        }
    }


class MLACacheModule(nn.Module):
    """Exports ``create_paged_kv_cache``: an ``MLAPagedKVCache`` for ``target`` (a Target or its
    dict) with these shapes."""

    def __init__(  # pylint: disable=too-many-arguments
        self,
        target: tvm.target.Target | dict,
        *,
        layers: int = 2,
        heads: int = 16,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        dtype: str = "float16",
    ) -> None:
        self.target = tvm.target.Target(target) if isinstance(target, dict) else target
        self.shapes = {
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "kv_lora_rank": kv_lora_rank,
            "qk_nope_head_dim": qk_nope_head_dim,
            "qk_rope_head_dim": qk_rope_head_dim,
            "v_head_dim": v_head_dim,
            "dtype": dtype,
        }

    def create_paged_kv_cache(  # pylint: disable=too-many-arguments
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding
    ):
        return MLAPagedKVCache(
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding,
            target=self.target,
            **self.shapes,
        )


def create_script(target: tvm.target.Target | dict, **shapes) -> tuple[set[str], str]:
    """Export ``create_paged_kv_cache`` alone (V2-Lite shapes, ``shapes`` overriding them, e.g.
    ``heads`` or ``dtype``): (function names of the module, the script of
    ``create_paged_kv_cache``)."""
    mod, _ = MLACacheModule(target, **shapes).export_tvm(spec=create_spec())
    return {gv.name_hint for gv in mod.get_global_vars()}, mod["create_paged_kv_cache"].script()
