"""The C++ CPU kernels (layers/cpu_kernels.cpp): paged decode attention against gather + SDPA, thread binding, and the
engine with and without them."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from pdfleet_worker.layers import attention, cpu_kernels
from pdfleet_worker.layers.attention import KVCache, gather_kv, write_kv
from pdfleet_worker.sampling_params import SamplingParams
from tests.worker.oracle import MAX_NEW, compare, random_prompts, run_and_capture

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.load(), reason="no C++ compiler: the engine runs without the kernels"
)


def _reference(q: torch.Tensor, cache: KVCache, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Gather every context (padded), mask past each length, SDPA in fp32. q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = cache.kv.shape[1]
    k, v = gather_kv(cache, tables, torch.float32)  # [Hkv, B, W * bs, D]
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[None, :, None, :]
    qd = q.float().view(b, hkv, hq // hkv, d).transpose(0, 1)
    return F.scaled_dot_product_attention(qd, k.float(), v.float(), attn_mask=mask).transpose(0, 1).reshape(b, hq, d)


def _pool(hkv: int, nb: int, bs: int, d: int, dtype: torch.dtype, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        cache = KVCache(torch.zeros(2, hkv, nb, bs, d, dtype=torch.int8), torch.zeros(2, hkv, nb))
        x = torch.randn(nb * bs, 2, hkv, d, generator=g) * torch.rand(nb * bs, 1, hkv, 1, generator=g) * 3
        write_kv(cache, x, torch.arange(nb * bs))
        return cache
    return KVCache(torch.randn(2, hkv, nb, bs, d, generator=g).to(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.int8, 2e-5)])
@pytest.mark.parametrize(
    "hq,hkv,d,bs", [(12, 4, 64, 16), (4, 1, 32, 4), (8, 8, 128, 7), (6, 2, 48, 1), (2, 1, 288, 3), (4, 2, 256, 5)]
)
def test_paged_decode_matches_gather_and_sdpa(dtype, atol, hq, hkv, d, bs):
    """Scattered block tables, lengths at and around block edges (1, bs, bs + 1, a full table),
    GQA, MQA and MHA, head dims from 32 to 288; the query is a strided view as in the model."""
    nb, width = 40, 9
    cache = _pool(hkv, nb, bs, d, dtype, seed=hq * d + bs)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, bs, bs + 1, width * bs, 3 * bs - 1, 5])
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens])
    qdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    heads = torch.randn(len(lens), hq + 2 * hkv, d, generator=g).to(qdtype)
    q = heads[:, :hq]  # [B, Hq, D], rows hq + 2 hkv heads apart
    out = torch.full_like(q, float("nan"))
    torch.ops.pdfleet.paged_decode_attention(out, q, cache.kv, cache.scale, tables, lens, d**-0.5)
    want = _reference(q, cache, tables, lens)
    assert out.dtype == qdtype and not out.isnan().any()
    assert torch.allclose(out.float(), want, atol=atol, rtol=0), float((out.float() - want).abs().max())


@needs_kernels
def test_paged_decode_ignores_what_lies_past_each_context():
    """Blocks past a context and slots past its length hold garbage (here inf): never read."""
    cache = _pool(2, 8, 4, 32, torch.float32, seed=3)
    tables, lens = torch.tensor([[5, 2, 7]]), torch.tensor([6])
    want = _reference(torch.ones(1, 4, 32), cache, tables, lens)
    cache.kv[:, :, 2, 2:] = float("inf")  # the second block's unused half
    cache.kv[:, :, 7] = float("inf")  # the block past the context
    out = torch.empty(1, 4, 32)
    torch.ops.pdfleet.paged_decode_attention(out, torch.ones(1, 4, 32), cache.kv, None, tables, lens, 32**-0.5)
    assert torch.allclose(out, want, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize("lens,error", [([0], "context length 0"), ([13], "context length 13")])
def test_paged_decode_refuses_lengths_its_table_cannot_hold(lens, error):
    cache = _pool(1, 4, 4, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match=error):
        torch.ops.pdfleet.paged_decode_attention(
            torch.empty(1, 1, 16),
            torch.ones(1, 1, 16),
            cache.kv,
            None,
            torch.tensor([[0, 1, 2]]),
            torch.tensor(lens),
            0.25,
        )


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 SDPA with an explicit bottom-right causal mask. q: [n, Hq, D]; k, v: [Lk, Hkv, D] -> [n, Hq, D]."""
    n, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lk - n, lk)[:, None]
    qf, kf, vf = (x.float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


@needs_kernels
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "n,past,hq,hkv,d",
    [
        (512, 0, 12, 4, 64),  # whole tiles and key blocks
        (100, 0, 4, 1, 32),  # MQA, a tail tile, a tail key block
        (1, 0, 8, 8, 128),  # MHA, one query
        (70, 130, 6, 2, 48),  # a chunk with a past that is no multiple of the key block
        (3, 61, 2, 1, 16),  # a short chunk whose keys straddle a block edge
        # head sizes of the bf16 dot-product path (AVX512-BF16): a past that is no multiple of the key block
        (70, 130, 6, 2, 64),
        (33, 200, 8, 2, 128),
    ],
)
def test_prefill_attention_matches_causal_sdpa(dtype, atol, n, past, hq, hkv, d):
    """Queries, keys and values are the model's strided views of its fused q/k/v rows."""
    g = torch.Generator().manual_seed(n * 7 + past)
    heads = torch.randn(n, hq + 2 * hkv, d, generator=g).to(dtype)
    q, new = heads[:, :hq], heads[:, hq:].unflatten(1, (2, hkv))
    old = torch.randn(past, 2, hkv, d, generator=g).to(dtype)
    kv = torch.cat([old, new])  # [Lk, 2, Hkv, D]
    out = torch.full_like(q, float("nan"))
    torch.ops.pdfleet.prefill_attention(out, q, kv[:, 0], kv[:, 1], d**-0.5)
    want = _causal_reference(q, kv[:, 0], kv[:, 1])
    assert out.dtype == dtype and not out.isnan().any()
    assert torch.allclose(out.float(), want, atol=atol, rtol=0), float((out.float() - want).abs().max())


@needs_kernels
def test_prefill_attention_keeps_each_query_to_the_keys_before_it():
    """Rewriting the last key and value (seen by the last query only) leaves every other row as it was."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(70, 4, 32, generator=g)
    k, v = torch.randn(90, 2, 32, generator=g), torch.randn(90, 2, 32, generator=g)
    before, after = torch.empty_like(q), torch.empty_like(q)
    torch.ops.pdfleet.prefill_attention(before, q, k, v, 32**-0.5)
    k[-1], v[-1] = 1e4, -1e4
    torch.ops.pdfleet.prefill_attention(after, q, k, v, 32**-0.5)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.allclose(before[-1], after[-1])


@needs_kernels
@pytest.mark.parametrize(
    "shapes,error",
    [
        (((4, 2, 16), (3, 1, 16)), "fewer keys than queries"),
        (((4, 3, 16), (4, 2, 16)), "multiple of KV heads"),
        (((4, 2, 16), (4, 1, 8)), r"k and v must be \[Lk, Hkv, D\]"),
    ],
)
def test_prefill_attention_refuses_shapes_it_cannot_serve(shapes, error):
    (qs, ks) = shapes
    q, k = torch.randn(*qs), torch.randn(*ks)
    with pytest.raises(RuntimeError, match=error):
        torch.ops.pdfleet.prefill_attention(torch.empty_like(q), q, k, k.clone(), 0.25)


@needs_kernels
def test_prefill_choice_by_setting_and_by_probe(monkeypatch):
    for kernel in attention.PREFILL_KERNELS:
        monkeypatch.setenv(attention.PREFILL_ENV, kernel)
        assert attention.choose_prefill(4, 2, 32, torch.float32) == attention.PrefillChoice(
            kernel, f"{attention.PREFILL_ENV}={kernel}"
        )
    monkeypatch.setenv(attention.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match="expected auto, sdpa or kernel"):
        attention.choose_prefill(4, 2, 32, torch.float32)
    monkeypatch.delenv(attention.PREFILL_ENV)
    monkeypatch.setattr(attention, "_PREFILL_PROBED", {})
    probed = attention.choose_prefill(4, 2, 32, torch.bfloat16)
    assert probed.source == "probe" and probed.sdpa_ms > 0 and probed.kernel_ms > 0
    assert probed.kernel == ("kernel" if probed.kernel_ms < probed.sdpa_ms else "sdpa")
    assert "sdpa" in probed.describe() and "kernel" in probed.describe()
    # once per process and heads: a second engine takes the first one's path, not a second timing's
    assert attention.choose_prefill(4, 2, 32, torch.bfloat16) is probed


@needs_kernels
def test_prefill_probe_keeps_sdpa_when_the_kernel_fails_here(monkeypatch):
    """A torch build whose brgemm cannot run on this CPU raises inside the kernel: the engine starts on SDPA."""

    def broken(out, q, k, v, scale):
        raise RuntimeError("brgemm: unsupported ISA")

    monkeypatch.setattr(torch.ops.pdfleet, "prefill_attention", broken)
    monkeypatch.delenv(attention.PREFILL_ENV, raising=False)
    monkeypatch.setattr(attention, "_PREFILL_PROBED", {})
    choice = attention.choose_prefill(4, 2, 32, torch.float32)
    assert choice.kernel == "sdpa" and "unsupported ISA" in choice.source


@needs_kernels
def test_engine_prefills_the_same_through_sdpa_and_the_kernel(tiny, make_engine, monkeypatch):
    """Prompts long enough for several tiles, chunked across steps (a past), and a prefix-cache hit:
    both prefill paths match transformers (fp32), and the runner takes the one it was told to."""
    base = random_prompts(4, 90, 200, seed=5)
    prompts = base + [base[0][:150] + p[:40] for p in base[1:3]]  # shared prefixes: chunks with a past
    op = torch.ops.pdfleet.prefill_attention
    for kernel in attention.PREFILL_KERNELS:
        calls = []  # (queries, keys) of each kernel call

        def counted(out, q, k, v, scale, calls=calls):
            calls.append((q.shape[0], k.shape[0]))
            return op(out, q, k, v, scale)

        monkeypatch.setattr(torch.ops.pdfleet, "prefill_attention", counted)
        monkeypatch.setenv(attention.PREFILL_ENV, kernel)
        eng = make_engine(tiny.path, block_size=16, max_num_batched_tokens=128)
        assert eng.model_runner.prefill_kernel == (kernel == "kernel")
        calls.clear()  # the probe's own calls
        tokens, logits, _ = run_and_capture(eng, prompts)
        assert compare(tiny, prompts, tokens, logits, MAX_NEW).near_ties <= 1
        if kernel == "kernel":  # fresh prompts and chunks with a past both went through it
            assert any(n == lk for n, lk in calls) and any(lk > n for n, lk in calls), calls
        else:
            assert not calls


def _add_rms_norm_reference(x, delta, weight, eps):
    """Hugging Face's LlamaRMSNorm after the residual add: h = x + delta in x's dtype, the norm in fp32, cast back,
    then the weight. Returns (h, y)."""
    h = x if delta is None else x + delta
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h, y


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 768), (37, 256), (9, 40), (512, 768)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_pytorch_ops(dtype, rows, width, with_delta):
    """Widths with and without a 16-lane tail, one row (the calling thread) and many (parallel); x and delta are
    strided rows of wider buffers, as the residual stream and an MLP output can be. x is updated in place."""
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width + 8, generator=g) * 3).to(dtype)[:, :width]
    delta = torch.randn(rows, width + 24, generator=g).to(dtype)[:, 4 : 4 + width] if with_delta else None
    weight = torch.randn(width, generator=g).to(dtype)
    want_h, want_y = _add_rms_norm_reference(x.clone(), delta, weight, 1e-5)
    y = torch.ops.pdfleet.add_rms_norm(x, delta, weight, 1e-5)
    if dtype == torch.bfloat16:  # the same roundings in the same places: equal but for the sum's order
        assert torch.equal(x, want_h)
        assert (y.float() - want_y.float()).abs().max() <= 2**-7 * want_y.float().abs().max()
        assert (y != want_y).float().mean() < 0.001
    else:
        assert torch.equal(x, want_h)
        assert torch.allclose(y, want_y, atol=2e-6, rtol=2e-6), float((y - want_y).abs().max())


@needs_kernels
def test_add_rms_norm_keeps_a_nan_a_nan():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    y = torch.ops.pdfleet.add_rms_norm(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    assert y[0].isnan().all() and not y[1].isnan().any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 2048), (37, 264), (9, 20), (512, 2048)])
def test_silu_and_mul_matches_the_pytorch_ops(dtype, rows, inter):
    """silu(gate) * up of a fused [T, 2I] gate_up output (a strided view, as a wider buffer's rows are), widths with
    and without a 16-lane tail, gates from -90 to 90 (exp(-|g|) underflows at the ends), against PyTorch's silu
    then mul in the same dtype."""
    g = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter + 6, generator=g) * 4).to(dtype)[:, : 2 * inter]
    x[0, :3] = torch.tensor([-90.0, 90.0, 0.0], dtype=dtype)
    gate, up = x.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = torch.ops.pdfleet.silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.bfloat16:  # the same two roundings; sigmoid by another formula can move one by an ulp
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.01
    else:
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), float((got - want).abs().max())


@needs_kernels
def test_silu_and_mul_keeps_a_nan_a_nan():
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    x[1, 32 + 5] = float("nan")
    y = torch.ops.pdfleet.silu_and_mul(x)
    assert y[0, 3].isnan() and y[1, 5].isnan() and y.isnan().sum() == 2


@needs_kernels
def test_pin_threads_binds_each_compute_thread_and_unbinds():
    allowed = sorted(os.sched_getaffinity(0))
    try:
        assert cpu_kernels.pin_threads(allowed) == torch.get_num_threads()
        assert os.sched_getaffinity(0) == {allowed[0]}  # this thread is compute thread 0
    finally:
        assert cpu_kernels.pin_threads(allowed, exclusive=False) == torch.get_num_threads()
    assert os.sched_getaffinity(0) == set(allowed)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_decodes_the_same_with_and_without_the_kernel(tiny, make_engine, kv_cache_dtype):
    """Many sequences decoding together (scattered blocks, block size 4): through the kernel the
    engine still matches transformers (fp32), and int8 KV gives what the gather path gives."""
    prompts = random_prompts(8, 1, 30, seed=31)
    got = {}
    for kernel in (True, False):
        eng = make_engine(tiny.path, block_size=4, max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype)
        assert eng.model_runner.decode_kernel
        eng.model_runner.decode_kernel = kernel
        got[kernel] = run_and_capture(eng, prompts)
    if kv_cache_dtype == "auto":
        for kernel in (True, False):
            tokens, logits, _ = got[kernel]
            assert compare(tiny, prompts, tokens, logits, MAX_NEW).near_ties <= 1
    else:
        worst = max(float((a - b).abs().max()) for ra, rb in zip(got[True][1], got[False][1]) for a, b in zip(ra, rb))
        assert worst < 1e-3 * max(1.0, max(float(r.abs().max()) for rows in got[False][1] for r in rows)), worst


@needs_kernels
def test_kernel_library_is_cached_by_key(tmp_path, monkeypatch):
    built = cpu_kernels.build()  # loaded already: returns the cached file, compiles nothing
    assert built == cpu_kernels.library_path() and built.exists()
    monkeypatch.setenv("PDFLEET_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.library_path() == tmp_path / built.name  # the key does not depend on the folder


def test_concurrent_builders_compile_once(tmp_path, monkeypatch):
    """Workers that start together on a fresh machine share one compilation: the second waits on the
    lock and finds the library built."""
    monkeypatch.setenv("PDFLEET_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")  # part of the key; never run here
    real_flock, locking = fcntl.flock, threading.Semaphore(0)

    def flock(fd, op):
        locking.release()
        return real_flock(fd, op)

    compiled, inside = [], threading.Event()

    def compile_once_the_second_waits(out):
        compiled.append(out)
        inside.set()
        for who in ("this", "the second"):  # each builder asks for the lock once
            assert locking.acquire(timeout=10), f"{who} builder never reached the lock"
        out.write_bytes(b"library")

    monkeypatch.setattr(cpu_kernels.fcntl, "flock", flock)
    monkeypatch.setattr(cpu_kernels, "_compile", compile_once_the_second_waits)
    results = []
    first = threading.Thread(target=lambda: results.append(cpu_kernels.build()))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=lambda: results.append(cpu_kernels.build()))
    second.start()
    first.join(20)
    second.join(20)
    assert len(compiled) == 1 and results == [compiled[0]] * 2 and compiled[0].read_bytes() == b"library"


@pytest.mark.parametrize(
    "setting,threads,allowed,want",
    [
        ("auto", 2, {0, 1}, [0, 1]),  # a machine (or cpuset) of its own: bind
        ("auto", 2, {0, 1, 2, 3}, []),  # cores shared with others: leave placement to the kernel
        ("off", 2, {0, 1}, []),
        ("2-3", 2, {0, 1, 2, 3}, [2, 3]),
        ("1,3", 2, {0, 1, 2, 3}, [1, 3]),
    ],
)
def test_cores_to_bind(setting, threads, allowed, want):
    assert cpu_kernels.cores_to_bind(setting, threads, allowed) == want


@pytest.mark.parametrize(
    "setting,error",
    [("0-5", "cores \\[2, 3, 4, 5\\] are not allowed"), ("a-b", "not a core list"), ("3-1", "not a core list")],
)
def test_cores_to_bind_refuses(setting, error):
    with pytest.raises(ValueError, match=error):
        cpu_kernels.cores_to_bind(setting, 2, {0, 1})


@needs_kernels
def test_bound_steps_leave_the_callers_affinity_as_it_was(llama, make_engine, monkeypatch):
    """Compute threads are bound while a step runs; between steps the calling thread has the
    process's cores again, so what it starts (a subprocess) is not confined to one core."""
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("PDFLEET_CPU_BIND", ",".join(map(str, allowed)))
    eng = make_engine(llama.path)
    assert eng.model_runner.bind_cores == allowed
    seen = []
    eng.model_runner.model.register_forward_hook(lambda *_: seen.append(os.sched_getaffinity(0)))
    try:
        eng.generate(random_prompts(2, 3, 9, seed=2), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert seen and all(a == {allowed[0]} for a in seen)  # inside the step: compute thread 0's core
        assert os.sched_getaffinity(0) == set(allowed)
    finally:
        cpu_kernels.pin_threads(allowed, exclusive=False)


def _affinities() -> dict[int, set[int]]:
    """Every thread of this process: its cores."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            out[int(task)] = os.sched_getaffinity(int(task))
        except OSError:  # the thread ended meanwhile
            continue
    return out


@needs_kernels
def test_a_new_thread_stepping_the_engine_gets_its_own_team_bound(llama, make_engine, monkeypatch):
    """Each thread that steps has its own OpenMP team, whose threads start with the caller's affinity (compute thread
    0's core), so it must be bound anew. The first steps run on the worker's model-load thread, later ones on its
    engine thread, which glibc often gives the same thread id: keyed by that id, the engine thread's team was never
    bound and its threads shared one core (a tiny model on 2 threads went from 2 to 40 ms per token)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or torch.get_num_threads() < 2:
        pytest.skip("needs 2 cores and 2 compute threads")
    monkeypatch.setenv("PDFLEET_CPU_BIND", ",".join(map(str, allowed)))
    eng = make_engine(llama.path)
    seen: list[dict[int, set[int]]] = []
    eng.model_runner.model.register_forward_hook(lambda *_: seen.append(_affinities()))
    pins = []
    pin = cpu_kernels.pin_threads
    monkeypatch.setattr(cpu_kernels, "pin_threads", lambda *a, **k: pins.append(threading.get_ident()) or pin(*a, **k))
    callers: list[int] = []

    def steps_in_a_new_thread() -> None:
        def run() -> None:
            callers.append(threading.get_native_id())
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            eng.generate(random_prompts(2, 64, 96, seed=3), params)

        t = threading.Thread(target=run)
        t.start()
        t.join()

    try:
        steps_in_a_new_thread()  # as the model-load thread's warm-up
        before = set(_affinities())
        seen.clear()
        pins.clear()
        steps_in_a_new_thread()  # as the engine thread
        # NOTE: whatever its thread id: bound at every step (which also rebinds a team OpenMP rebuilt)
        assert len(pins) >= len(seen) >= 2
        team = {tid: cores for snapshot in seen for tid, cores in snapshot.items() if tid not in before}
        team.pop(callers[-1], None)
        assert team, "the second thread's steps ran on an OpenMP team of its own"
        assert all(len(cores) == 1 and cores != {allowed[0]} for cores in team.values()), (
            f"its compute threads bound each to a core of its own, not to thread 0's {allowed[0]}: {team}"
        )
    finally:
        cpu_kernels.pin_threads(allowed, exclusive=False)


@needs_kernels
@pytest.mark.slow
def test_compiled_decode_matches_transformers(llama, make_engine, monkeypatch):
    """PDFLEET_COMPILE=1: decode-only steps run torch.compile'd (KV write + paged attention one
    opaque op per layer); warm_up compiles both graphs, and the tokens stay exact."""
    monkeypatch.setenv("PDFLEET_COMPILE", "1")
    eng = make_engine(llama.path, block_size=4, max_num_batched_tokens=16)
    assert eng.model_runner.compiled is not None
    eng.warm_up()
    compiled, calls = eng.model_runner.compiled, []
    eng.model_runner.compiled = lambda *args: calls.append(args[0].numel()) or compiled(*args)
    prompts = random_prompts(6, 1, 30, seed=41)
    tokens, logits, _ = run_and_capture(eng, prompts)
    assert compare(llama, prompts, tokens, logits, MAX_NEW).near_ties <= 1
    assert max(calls) == len(prompts)  # the batched graph ran
    (alone,) = eng.generate(prompts[:1], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert 1 in calls and alone.new_token_ids == tokens[0]  # and the lone-decode one
