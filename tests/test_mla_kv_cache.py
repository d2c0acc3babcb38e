"""CPU tests of the MLA paged KV cache (``dsv2_mlc.model.kv_cache``) and its TIR kernels.

Part 1 builds each kernel of ``dsv2_mlc.schedules.mla_cpu`` alone and compares it with a plain
NumPy reference. Part 2 compiles a small nn module (LLVM, fp32) whose methods call only the
fine-grained PagedKVCache API, drives the C++ cache with the ``vm.builtin.kv_state_*`` globals
and checks every attention output against a float64 NumPy MLA (non-absorbed and absorbed give the
same function). The rule of a DeepSeek-V2 model is followed: prefill of fresh sequences ->
self-attention; decode (every append length 1) -> append, then absorbed cross-attention; otherwise
(extend) -> self-attention + cross-attention over the prefix + merge.
"""

import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from mla_cache_module import MLACacheModule, create_script, create_spec
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from dsv2_mlc.schedules import mla_cpu

H, R, P, NOPE, V, L = 4, 32, 8, 16, 16, 2  # heads, kv_lora_rank, rope, nope, v_head_dim, layers
DQK = R + P
SM_SCALE = (NOPE + P) ** -0.5
LOG2E = math.log2(math.e)
TOL = 1e-5
LLVM = tvm.target.Target({"kind": "llvm"})
MAX_ERR: dict[str, float] = {}  # test name -> max abs error seen (printed with -s)


def _record(name: str, err: float) -> None:
    MAX_ERR[name] = max(MAX_ERR.get(name, 0.0), float(err))
    print(f"{name}: max abs err {MAX_ERR[name]:.2e}")


def _t(x: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(x))


def _build(func) -> tvm.runtime.Module:
    return tvm.tirx.build(tvm.IRModule({"main": func}), target="llvm")


# ------------------------------------------------------------------ part 1: kernels alone


def ref_mla_paged_attention(q, qo_indptr, pages, page_indptr, page_indices, last_len, causal, sm):
    """NumPy reference of ``mla_paged_attention_cpu``: (out[total, H, R], lse2[total, H])."""
    page_size = pages.shape[1]
    total, heads, _ = q.shape
    out = np.zeros((total, heads, R))
    lse = np.full((total, heads), -np.inf)
    for b in range(len(qo_indptr) - 1):
        ids = page_indices[page_indptr[b] : page_indptr[b + 1]]
        rows = pages[ids].reshape(-1, pages.shape[2]).astype(np.float64)
        kv_len = (len(ids) - 1) * page_size + last_len[b] if len(ids) else 0
        rows = rows[:kv_len]
        q_len = qo_indptr[b + 1] - qo_indptr[b]
        for i in range(q_len):
            vis = min(kv_len, kv_len - q_len + i + 1) if causal else kv_len
            if vis <= 0:
                continue
            s = q[qo_indptr[b] + i].astype(np.float64) @ rows[:vis].T * sm  # [H, vis]
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            out[qo_indptr[b] + i] = p @ rows[:vis, :R] / p.sum(-1, keepdims=True)
            lse[qo_indptr[b] + i] = (np.log(p.sum(-1)) + m[:, 0]) * LOG2E
    return out, lse


@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("causal", [0, 1])
def test_kernel_mla_paged_attention(causal: int, page_size: int) -> None:
    rng = np.random.default_rng(0)
    f = _build(mla_cpu.mla_paged_attention_cpu(H, R, P, "float32"))
    # (q_len, kv_len): fresh sequence, partial page, multi-page, exactly one full page,
    # and q_len > kv_len (with causal, the first rows see no key at all).
    cases = [(2, 0), (3, 5), (4, 37), (1, page_size), (4, 2)]
    num_pages = 16
    pages = rng.standard_normal((num_pages, page_size, DQK)).astype("float32")
    perm = list(rng.permutation(num_pages))
    qo_indptr, page_indptr, page_indices, last_len = [0], [0], [], []
    for q_len, kv_len in cases:
        n = -(-kv_len // page_size)
        page_indices += [perm.pop() for _ in range(n)]
        qo_indptr.append(qo_indptr[-1] + q_len)
        page_indptr.append(page_indptr[-1] + n)
        last_len.append((kv_len - 1) % page_size + 1 if kv_len else 0)
    total = qo_indptr[-1]
    q = rng.standard_normal((total, H, DQK)).astype("float32")
    ints = [np.array(x, "int32") for x in (qo_indptr, page_indptr, page_indices, last_len)]
    out = np.full((total, H, R), np.nan, "float32")
    lse = np.full((total, H), np.nan, "float32")
    args = [_t(q), _t(ints[0]), _t(pages), _t(ints[1]), _t(ints[2]), _t(ints[3]), _t(out), _t(lse)]
    f(*args, causal, SM_SCALE)
    ref_out, ref_lse = ref_mla_paged_attention(q, *ints[:1], pages, *ints[1:], causal, SM_SCALE)
    got_out, got_lse = args[6].numpy(), args[7].numpy()
    empty = np.isneginf(ref_lse)
    assert empty[0:2].all()  # the fresh sequence
    assert np.array_equal(np.isneginf(got_lse), empty)
    assert not np.isnan(got_out).any()
    assert np.all(got_out[empty] == 0)
    err = max(np.abs(got_out - ref_out).max(), np.abs(got_lse[~empty] - ref_lse[~empty]).max())
    _record(f"kernel_attention[causal={causal},page={page_size}]", err)
    assert err < TOL


def ref_merge(v, s, vo, so):
    """NumPy reference of ``merge_state_inplace_cpu`` (base-2 lse, empty = -inf)."""
    m = np.maximum(s, so)
    safe_m = np.where(np.isneginf(m), 0.0, m)
    a, c = np.exp2(s - safe_m), np.exp2(so - safe_m)
    denom = np.where(a + c == 0, 1.0, a + c)
    v_new = (a[..., None] * v + c[..., None] * vo) / denom[..., None]
    s_new = np.where(np.isneginf(m), -np.inf, safe_m + np.log2(np.where(a + c == 0, 1, a + c)))
    return v_new, s_new


@pytest.mark.parametrize("head_dim", [None, 24])
def test_kernel_merge_state(head_dim: int | None) -> None:
    rng = np.random.default_rng(1)
    f = _build(mla_cpu.merge_state_inplace_cpu("float32", head_dim))
    n, d = 6, 24
    v, vo = (rng.standard_normal((n, H, d)).astype("float32") for _ in range(2))
    s, so = (rng.standard_normal((n, H)).astype("float32") * 4 for _ in range(2))
    s[0], so[0] = -np.inf, -np.inf  # both empty
    s[1] = -np.inf  # self empty
    so[2] = -np.inf  # other empty
    s[3, :2], so[3, 1:3] = -np.inf, -np.inf  # mixed per head
    args = [_t(v), _t(s), _t(vo), _t(so)]
    f(*args)
    ref_v, ref_s = ref_merge(v.astype(np.float64), s, vo.astype(np.float64), so)
    got_v, got_s = args[0].numpy(), args[1].numpy()
    assert not np.isnan(got_v).any() and not np.isnan(got_s).any()
    assert np.all(got_v[0] == 0) and np.all(np.isneginf(got_s[0]))
    assert np.array_equal(np.isneginf(got_s), np.isneginf(ref_s))
    fin = ~np.isneginf(ref_s)
    err = max(np.abs(got_v - ref_v).max(), np.abs(got_s[fin] - ref_s[fin]).max())
    _record(f"kernel_merge[d={head_dim}]", err)
    assert err < TOL


def test_kernel_page_ops() -> None:
    """copy_single_page / transpose_append / compact_kv_copy against NumPy index moves."""
    rng = np.random.default_rng(2)
    for page_size in (16, 8):
        pages = rng.standard_normal((5, page_size, DQK)).astype("float32")
        # copy_single_page: first 7 rows of page 1 -> page 3
        ref = pages.copy()
        ref[3, :7] = ref[1, :7]
        t = _t(pages)
        _build(mla_cpu.copy_single_page_mla_cpu(DQK, "float32"))(t, 1, 3, 7)
        assert np.array_equal(t.numpy(), ref)
        # transpose_append: rows to global slots (page * P + offset); -1 is skipped
        kv = rng.standard_normal((4, DQK)).astype("float32")
        pos = np.array([0, 2 * page_size + 5, -1, 4 * page_size + page_size - 1], "int32")
        for i, p in enumerate(pos):
            if p >= 0:
                ref[p // page_size, p % page_size] = kv[i]
        _build(mla_cpu.kv_cache_transpose_append_mla_cpu(DQK, "float32"))(t, _t(kv), _t(pos))
        assert np.array_equal(t.numpy(), ref)
        # compact_kv_copy: batch of 2, copy pairs (src, dst) applied in order
        indptr = np.array([0, 2, 3], "int32")
        src_dst = np.array([[page_size + 3, 7, 4 * page_size + 1], [1, 2, page_size]], "int32")
        for src, dst in src_dst.T:
            ref[dst // page_size, dst % page_size] = ref[src // page_size, src % page_size]
        f = _build(mla_cpu.compact_kv_copy_mla_cpu(DQK, "float32"))
        f(t, _t(indptr), _t(src_dst), 2)
        assert np.array_equal(t.numpy(), ref)


# ------------------------------------------------------------------ part 2: the cache in a VM


class MLAAttention(MLACacheModule):
    """Exports the cache constructor and thin wrappers of the fine-grained cache API."""

    def __init__(self, target: tvm.target.Target) -> None:
        super().__init__(
            target,
            layers=L,
            heads=H,
            kv_lora_rank=R,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=P,
            v_head_dim=V,
            dtype="float32",
        )

    def append_mla_kv(self, layer_id, kv, cache):
        return cache.append_mla_kv(layer_id, kv)

    def self_attention(self, layer_id, q, k, v, cache):
        return cache.self_attention(layer_id, q, k, v, SM_SCALE)

    def cross_attention(self, layer_id, q, cache):
        return cache.cross_attention(layer_id, q, R, SM_SCALE)

    def merge_attn_output_inplace(self, o_self, lse_self, o_cross, lse_cross, cache):
        return cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)


def _spec() -> dict:
    none = {"$": {"param_mode": "none", "effect_mode": "none"}}
    obj = nn.spec.Object(object_type=PagedKVCache)

    def ten(shape):
        return nn.spec.Tensor(shape, "float32")

    return {
        **create_spec(),
        "append_mla_kv": {"layer_id": int, "kv": ten(["b", "s", 1, DQK]), "cache": obj, **none},
        "self_attention": {
            "layer_id": int,
            "q": ten([1, "n", H, NOPE + P]),
            "k": ten([1, "n", H, NOPE + P]),
            "v": ten([1, "n", H, V]),
            "cache": obj,
            **none,
        },
        "cross_attention": {"layer_id": int, "q": ten(["b", "s", H, DQK]), "cache": obj, **none},
        "merge_attn_output_inplace": {
            "o_self": ten(["b", "s", H, V]),
            "lse_self": ten(["b", "s", H]),
            "o_cross": ten(["b", "s", H, V]),
            "lse_cross": ten(["b", "s", H]),
            "cache": obj,
            **none,
        },
    }


@pytest.fixture(scope="module")
def vm() -> tvm.runtime.vm.VirtualMachine:
    mod, _ = MLAAttention(LLVM).export_tvm(spec=_spec())
    return tvm.runtime.vm.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())


def _shape(*v: int) -> tvm_ffi.Shape:
    return tvm_ffi.Shape(list(v))


def _g(name: str):
    return tvm.get_global_func(f"vm.builtin.{name}")


class Harness:
    """Drives one cache and a float64 reference of the same sequences."""

    def __init__(self, vm, page_size: int = 16, seed: int = 0, max_batch: int = 8) -> None:
        self.vm = vm
        self.rng = np.random.default_rng(seed)
        self.cache = vm["create_paged_kv_cache"](
            _shape(max_batch), _shape(2048), _shape(256), _shape(page_size), _shape(0)
        )
        self.w_uk = self.rng.standard_normal((L, H, NOPE, R)) / math.sqrt(R)
        self.w_uv = self.rng.standard_normal((L, H, V, R)) / math.sqrt(R)
        self.hist: dict[int, list[np.ndarray]] = {}  # seq -> per layer rows [c | k_pe]

    def add(self, sid: int) -> None:
        _g("kv_state_add_sequence")(self.cache, sid)
        self.hist[sid] = [np.zeros((0, DQK)) for _ in range(L)]

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        _g("kv_state_fork_sequence")(self.cache, parent, child, pos)
        end = len(self.hist[parent][0]) if pos < 0 else pos
        self.hist[child] = [h[:end].copy() for h in self.hist[parent]]

    def popn(self, sid: int, n: int) -> None:
        _g("kv_state_popn")(self.cache, sid, n)
        self.hist[sid] = [h[: len(h) - n] for h in self.hist[sid]]

    def length(self, sid: int) -> int:
        return int(_g("attention_kv_cache_get_sequence_length")(self.cache, sid))

    def _reference(self, layer, sid, rows, qn, qp):
        """Non-absorbed causal MLA of new tokens over history + themselves: (out, lse2)."""
        keys = np.concatenate([self.hist[sid][layer], rows])
        c, kpe = keys[:, :R], keys[:, R:]
        k_nope = np.einsum("hnr,tr->thn", self.w_uk[layer], c)
        val = np.einsum("hvr,tr->thv", self.w_uv[layer], c)
        prefix, out, lse = len(self.hist[sid][layer]), [], []
        for i in range(len(rows)):
            n = prefix + i + 1
            s = (np.einsum("hn,thn->ht", qn[i], k_nope[:n]) + qp[i] @ kpe[:n].T) * SM_SCALE
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            out.append(np.einsum("ht,thv->hv", p / p.sum(-1, keepdims=True), val[:n]))
            lse.append((np.log(p.sum(-1)) + m[:, 0]) * LOG2E)
        return np.stack(out), np.stack(lse)

    def step(self, seq_ids: list[int], lens: list[int], name: str, decode: bool | None = None):
        """One forward of all layers; asserts the outputs and returns the cross lse (last layer).

        ``decode`` (default: every length is 1) picks append + cross-attention only; otherwise
        self-attention, plus cross-attention and merge when some sequence has a cached prefix.
        """
        decode = all(n == 1 for n in lens) if decode is None else decode
        fresh = [len(self.hist[s][0]) == 0 for s in seq_ids]
        ntot, vm = sum(lens), self.vm
        lay = (len(lens), 1) if decode else (1, ntot)  # [b, s] layout of the inputs
        _g("kv_state_begin_forward")(self.cache, _shape(*seq_ids), _shape(*lens))
        lse_cross = None
        for layer in range(L):
            lid = _shape(layer)
            rows = self.rng.standard_normal((ntot, DQK))
            qn = self.rng.standard_normal((ntot, H, NOPE))
            qp = self.rng.standard_normal((ntot, H, P))
            ref_out, ref_lse, off = [], [], 0
            for sid, n in zip(seq_ids, lens, strict=True):
                o, lse = self._reference(layer, sid, rows[off : off + n], qn[off:], qp[off:])
                ref_out.append(o)
                ref_lse.append(lse)
                off += n
            f32 = np.float32
            self.cache = vm["append_mla_kv"](
                lid, _t(rows.reshape(*lay, 1, DQK).astype(f32)), self.cache
            )
            q_abs = np.concatenate([np.einsum("thn,hnr->thr", qn, self.w_uk[layer]), qp], -1)
            q_abs = _t(q_abs.reshape(*lay, H, DQK).astype(f32))
            w_uv = self.w_uv[layer].astype(f32)
            if decode:  # the runtime appended before attention: cross covers the new token
                o_lat, lse = vm["cross_attention"](lid, q_abs, self.cache)
                out = np.einsum("bshr,hvr->bshv", o_lat.numpy(), w_uv)
            else:
                c, kpe = rows[:, :R], rows[:, R:]
                k = np.concatenate(
                    [
                        np.einsum("hnr,tr->thn", self.w_uk[layer], c),
                        np.broadcast_to(kpe[:, None, :], (ntot, H, P)),
                    ],
                    -1,
                )
                v = np.einsum("hvr,tr->thv", self.w_uv[layer], c)
                q = np.concatenate([qn, qp], -1)
                o_self, lse = vm["self_attention"](
                    lid, *(_t(x[None].astype(f32)) for x in (q, k, v)), self.cache
                )
                out = o_self.numpy()
                if not all(fresh):  # extend: merge with cross-attention over the cached prefix
                    o_lat, lse_c = vm["cross_attention"](lid, q_abs, self.cache)
                    lse_cross = lse_c.numpy().reshape(ntot, H)
                    o_lat_np = o_lat.numpy().reshape(ntot, H, R)
                    mask = np.repeat(fresh, lens)  # rows of fresh sequences saw no cached key
                    assert np.all(np.isneginf(lse_cross[mask]))
                    assert np.all(o_lat_np[mask] == 0)
                    assert np.all(np.isfinite(lse_cross[~mask]))
                    o_c = _t(np.einsum("bshr,hvr->bshv", o_lat.numpy(), w_uv))
                    out, lse = vm["merge_attn_output_inplace"](o_self, lse, o_c, lse_c, self.cache)
                    out = out.numpy()
            got_out, got_lse = out.reshape(ntot, H, V), lse.numpy().reshape(ntot, H)
            err_o = np.abs(got_out - np.concatenate(ref_out)).max()
            err_l = np.abs(got_lse - np.concatenate(ref_lse)).max()
            _record(name, max(err_o, err_l))
            assert err_o < TOL and err_l < TOL, (name, layer, err_o, err_l)
            off = 0
            for sid, n in zip(seq_ids, lens, strict=True):
                self.hist[sid][layer] = np.concatenate([self.hist[sid][layer], rows[off : off + n]])
                off += n
        _g("kv_state_end_forward")(self.cache)
        for sid in seq_ids:
            assert self.length(sid) == len(self.hist[sid][0])
        return lse_cross


def test_prefill_fresh(vm) -> None:
    h = Harness(vm)
    h.add(0)
    h.add(1)
    h.step([0, 1], [7, 20], "prefill_fresh")  # batched, self-attention only
    h.add(2)
    h.step([2], [33], "prefill_fresh")


def test_chunked_prefill(vm) -> None:
    h = Harness(vm, seed=1)
    h.add(0)
    for chunk in (13, 13, 14, 1, 3):  # crosses page boundaries; the 1 is a decode step
        h.step([0], [chunk], "chunked_prefill" if chunk > 1 else "decode")


def test_decode(vm) -> None:
    h = Harness(vm, seed=2)
    h.add(0)
    h.step([0], [15], "prefill")
    for _ in range(3):  # positions 15, 16 (new page), 17
        h.step([0], [1], "decode")


def test_batch_decode(vm) -> None:
    h = Harness(vm, seed=3)
    for sid, n in ((0, 5), (1, 16), (2, 33)):
        h.add(sid)
        h.step([sid], [n], "prefill")
    h.add(3)  # a fresh sequence decoding its first token in the same batch
    for _ in range(3):
        h.step([0, 1, 2, 3], [1, 1, 1, 1], "batch_decode")


@pytest.mark.parametrize("page_size", [16, 8])
def test_fork_and_popn(vm, page_size: int) -> None:
    h = Harness(vm, page_size=page_size, seed=4)
    h.add(0)
    h.step([0], [37], "prefill")
    h.fork(0, 1, 7)  # inside the first page: copy_single_page
    h.fork(0, 2, 21)  # inside a later page: shared parent block + copy
    h.fork(0, 3, page_size)  # at a page boundary: no copy
    h.fork(0, 4)  # at the end (-1)
    assert [h.length(s) for s in range(5)] == [37, 7, 21, page_size, 37]
    for _ in range(2):  # multi-depth cross-attention merged with merge[0]
        h.step([0, 1, 2, 3, 4], [1] * 5, f"fork_decode[page={page_size}]")
    h.step([2, 1], [3, 4], f"fork_extend[page={page_size}]")
    h.popn(0, 3)  # inside its own last block
    h.popn(2, 12)  # reaches into the shared parent block (the runtime re-forks)
    h.popn(4, 20)
    for _ in range(2):
        h.step([0, 2, 4], [1, 1, 1], f"popn_decode[page={page_size}]")
    _g("kv_state_remove_sequence")(h.cache, 1)
    h.step([3], [2], f"popn_extend[page={page_size}]")


def test_mixed_extend_fresh_and_prefix(vm) -> None:
    h = Harness(vm, seed=5)
    h.add(0)
    h.step([0], [20], "prefill")
    h.fork(0, 3, 18)  # 3 = a shared 16-token parent block + its own block (two depths)
    h.add(1)
    h.add(2)
    # Fresh sequences (1, 2) and ones with a prefix (0; 3 on two depths) in one extend: the
    # cross-attention kernel sees zero pages for 1 and 2 on both depths and must give out = 0,
    # lse = -inf; merging the two depths must stay -inf (not NaN); the final merge keeps self.
    lse_cross = h.step([1, 0, 3, 2], [5, 4, 2, 3], "mixed_extend")
    assert np.isneginf(lse_cross[:5]).all() and np.isneginf(lse_cross[11:]).all()
    h.step([1, 0, 3, 2], [1, 1, 1, 1], "decode_after_mixed")


@pytest.mark.parametrize("num_children", [31, 32])
def test_decode_append_rule_with_shared_blocks(vm, num_children: int) -> None:
    """The runtime appends before attention only if, at the last block depth, the pages of the
    batch's blocks over the pages of the coalesced (consecutive equal) blocks is < 32. With 32
    consecutive sequences sharing their second block it is 32, the new token is NOT in the page
    table, and a decode step needs the extend path (self + cross + merge) instead."""
    h = Harness(vm, seed=6, max_batch=40)
    h.add(0)
    h.step([0], [32], "prefill")
    h.fork(0, 1, 16)  # splits 0 into [16-token root block, 16-token block]
    kids = list(range(2, 2 + num_children))
    for kid in kids:  # each child: [root, shared 16-token block, own empty block]
        h.fork(0, kid)
    h.step(kids, [1] * num_children, f"shared_decode[{num_children}]", decode=num_children < 32)


def test_cuda_target_constructs() -> None:
    """For CUDA the class delegates to TVM's TIRPagedKVCache (export only; no GPU here)."""

    model = MLAAttention(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    mod, _ = model.export_tvm(spec={"create_paged_kv_cache": _spec()["create_paged_kv_cache"]})
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert "batch_prefill_paged_kv_mla" in names
    assert "paged_attention_kv_cache_create" in mod["create_paged_kv_cache"].script()


@pytest.mark.parametrize(("dtype", "ours"), [("float16", True), ("bfloat16", False)])
def test_cuda_cache_append_slot(dtype: str, ours: bool) -> None:
    """On CUDA the latent append is ours (``mla_append_cuda``) where it supports the dtype and
    TVM's where it does not (bfloat16); the cache's create call takes exactly one of them."""
    names, script = create_script({"kind": "cuda", "arch": "sm_90"}, dtype=dtype)
    mine, tvms = "mla_append_release_first", "tir_kv_cache_transpose_append_mla"
    used, unused = (mine, tvms) if ours else (tvms, mine)
    assert used in names and (mine in names) == ours
    create = next(line for line in script.splitlines() if "kv_cache_create" in line)
    assert f" {used}," in create and f" {unused}," not in create
