"""Tree acceptance: kernel == reference, greedy == brute-force argmax path, and exactness of sampling
(every emitted token distributed as the target's filtered distribution) by chi-square tests."""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from scipy import stats  # noqa: E402

from tlt_rt.codegen.kernels import accept as acc  # noqa: E402
from tlt_rt.codegen.kernels.sampling import filtered_probs  # noqa: E402

if not torch.cuda.is_available() and not acc._is_interpreted():
    acc = importlib.reload(acc)  # imported earlier in this process without the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Kernel and reference both compute in float32 from the same input values, so the tolerance does not
# depend on the logits dtype; it covers sum-order and exp-implementation differences.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-5, 1e-5), torch.float16: (2e-5, 1e-5)}
BOUNDARY_TOL = 1e-5  # relative: a uniform this close to a CDF boundary may fall either way


# ------------------------------------------------------------------------------------------------ inputs
def make_case(seed, B, T, V, D, dtype, mode, top_k_on, top_p_on, noncontig=False, neg_inf=False, device=DEVICE):
    """Random logits (with neg_inf, about 10% banned at -inf) and a random valid tree whose draft tokens
    are often the parent's top tokens (so that greedy and sampled acceptance both walk deep), duplicates
    among siblings included."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V + 3, generator=g) * 3.0
    if neg_inf:
        logits[torch.rand(B, T, V + 3, generator=g) < 0.1] = float("-inf")
        logits[..., 0] = 0.0  # no row entirely banned
    logits = logits.to(dtype)
    logits = logits[..., :V] if noncontig else logits[..., :V].contiguous()
    parents = (torch.rand(B, T, generator=g) * torch.arange(T)).long()
    parents[:, 0] = -1
    top = logits.float().topk(min(3, V), dim=-1).indices  # [B, T, 3]
    pick = torch.randint(0, top.shape[-1], (B, T, 1), generator=g)
    from_parent = top.gather(1, parents.clamp_min(0)[..., None].expand_as(top)).gather(2, pick).squeeze(2)
    tokens = torch.where(torch.rand(B, T, generator=g) < 0.7, from_parent, torch.randint(0, V, (B, T), generator=g))
    if noncontig:
        tokens = tokens.t().contiguous().t()
    temperature = torch.rand(B, generator=g) + 0.5
    if mode == "greedy_rows":
        temperature.zero_()
    elif mode == "mixed":
        temperature[::2] = 0.0
    top_k = torch.where(torch.rand(B, generator=g) < 0.8, torch.randint(1, V + 1, (B,), generator=g), -1)
    top_k = top_k.int() if top_k_on else torch.full((B,), -1, dtype=torch.int32)
    top_p = (torch.rand(B, generator=g) * 0.5 + 0.45) if top_p_on else torch.ones(B)
    uniforms = torch.rand(B, D + 1, 2, generator=g)
    args = (logits, tokens, parents, temperature, top_k, top_p, uniforms)
    return tuple(a.to(device) for a in args) + (D,)


# ------------------------------------------------------------------------------- comparing two acceptors
def _residual_cdf64(x, thr, scale, excluded):
    """float64 residual mass cumulative over token ids for one node row."""
    z = torch.where(x >= thr, x * scale, float("-inf"))
    e = torch.exp(z - z.max())
    e[excluded] = 0.0
    return e.cumsum(0), e


def assert_same_acceptance(out_k, out_r, case, all_greedy=False, max_diff_frac=0.0):
    """Equal outputs, except rows where the two part ways at a uniform within BOUNDARY_TOL of a CDF
    boundary (float rounding), which are checked against a float64 recomputation instead."""
    logits, tokens, parents, temperature, top_k, top_p, uniforms, D = case
    atol, rtol = TOLERANCES[logits.dtype]
    same = (out_k.accepted_tokens == out_r.accepted_tokens).all(1) & (out_k.accept_len == out_r.accept_len)
    same &= (out_k.accepted_nodes == out_r.accepted_nodes).all(1) & (out_k.bonus == out_r.bonus)
    torch.testing.assert_close(out_k.logprobs[same], out_r.logprobs[same], atol=atol, rtol=rtol)
    bad = (~same).nonzero().flatten().tolist()
    assert len(bad) <= max_diff_frac * len(same), f"{len(bad)} rows differ: {bad}"
    thr = acc.filter_thresholds(logits, temperature, top_k, top_p)
    for b in bad:
        assert not all_greedy and temperature[b] > 0, f"greedy row {b} differs"
        d = int((out_k.accepted_tokens[b] != out_r.accepted_tokens[b]).nonzero()[0])
        cur = 0 if d == 0 else int(out_r.accepted_nodes[b, d - 1])
        x = logits[b, cur].double()
        scale = 1.0 / float(temperature[b])
        kids = [c for c in range(logits.shape[1]) if int(parents[b, c]) == cur] if d < D else []
        kid_toks = list(dict.fromkeys(int(tokens[b, c]) for c in kids))
        _, e = _residual_cdf64(x, float(thr[b, cur]), scale, [])
        p = e / e.sum()
        cum = torch.cumsum(p[kid_toks], 0) if kid_toks else torch.zeros(0, dtype=torch.float64)
        u0, u1 = float(uniforms[b, d, 0]), float(uniforms[b, d, 1])
        if bool(((cum - u0).abs() < BOUNDARY_TOL).any()):
            continue
        assert int(out_k.accepted_nodes[b, d]) == int(out_r.accepted_nodes[b, d]) == -1, f"row {b}: accept"
        c, r = _residual_cdf64(x, float(thr[b, cur]), scale, kid_toks)
        for tok in (int(out_k.accepted_tokens[b, d]), int(out_r.accepted_tokens[b, d])):
            lo = float(c[tok - 1]) if tok > 0 else 0.0
            target = u1 * float(c[-1])
            assert r[tok] > 0 and lo - BOUNDARY_TOL * c[-1] <= target <= c[tok] + BOUNDARY_TOL * c[-1], (
                f"row {b}: bonus {tok} is not a rounding-level disagreement"
            )


# ------------------------------------------------------------------------------- kernel == reference
@pytest.mark.parametrize("all_greedy", [False, True])
def test_small_fixed_case(all_greedy):
    case = make_case(1, 3, 10, 130, 4, torch.float32, "mixed", True, True)
    out_k = acc.accept_tree(*case, all_greedy=all_greedy, backend="triton", block_v=64)
    out_r = acc.accept_tree_reference(*case, all_greedy=all_greedy)
    assert_same_acceptance(out_k, out_r, case, all_greedy)
    assert int(out_r.accept_len.sum()) > 0  # the walk went below the root somewhere


@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 3),
    T=st.integers(2, 12),
    V=st.sampled_from([37, 130, 1000]),
    D=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    mode=st.sampled_from(["all_greedy", "greedy_rows", "sampled", "mixed"]),
    top_k_on=st.booleans(),
    top_p_on=st.booleans(),
    noncontig=st.booleans(),
    neg_inf=st.booleans(),
    block_v=st.sampled_from([64, 256, 1024]),
)
def test_kernel_matches_reference(seed, B, T, V, D, dtype, mode, top_k_on, top_p_on, noncontig, neg_inf, block_v):
    case = make_case(seed, B, T, V, D, dtype, mode, top_k_on, top_p_on, noncontig, neg_inf)
    all_greedy = mode == "all_greedy"
    out_k = acc.accept_tree(*case, all_greedy=all_greedy, backend="triton", block_v=block_v)
    out_r = acc.accept_tree_reference(*case, all_greedy=all_greedy)
    assert_same_acceptance(out_k, out_r, case, all_greedy)


def test_auto_backend_and_output_contract():
    case = make_case(3, 2, 8, 37, 3, torch.float32, "mixed", False, True)
    out = acc.accept_tree(*case)
    ref = acc.accept_tree(*case, backend="torch")
    assert_same_acceptance(out, ref, case)
    B, D = 2, 3
    assert out.accepted_tokens.shape == out.accepted_nodes.shape == out.logprobs.shape == (B, D + 1)
    for b in range(B):
        n = int(out.accept_len[b])
        assert out.accepted_tokens[b, n] == out.bonus[b] and out.accepted_nodes[b, n] == -1
        assert (out.accepted_tokens[b, n + 1 :] == -1).all() and (out.logprobs[b, n + 1 :] == 0).all()
        assert (out.accepted_nodes[b, :n] >= 1).all() and (out.logprobs[b, : n + 1] <= 0).all()


def test_bad_inputs_are_named():
    logits, tokens, parents, temperature, top_k, top_p, uniforms, D = make_case(
        0, 2, 5, 37, 2, torch.float32, "sampled", False, False, device="cpu"
    )
    with pytest.raises(AssertionError, match="uniforms"):
        acc.accept_tree(logits, tokens, parents, temperature, top_k, top_p, uniforms[:, :2], D)
    with pytest.raises(AssertionError, match="parents"):
        acc.accept_tree(logits, tokens, parents.int(), temperature, top_k, top_p, uniforms, D)
    with pytest.raises(AssertionError, match="logits dtype"):
        acc.accept_tree(logits.double(), tokens, parents, temperature, top_k, top_p, uniforms, D)
    with pytest.raises(ValueError, match="filtering=False"):  # checked where the values are on the host
        acc.accept_tree(logits, tokens, parents, temperature, top_k, top_p * 0.5, uniforms, D, filtering=False)


# --------------------------------------------------------------------------------------------- greedy
def _greedy_path(logits, tokens, parents, D):
    """Brute force, one sequence: follow the argmax (lowest id on ties) while a child carries it."""
    cur, emitted = 0, []
    for d in range(D + 1):
        row = logits[cur].float().tolist()
        t = row.index(max(row))
        kids = [c for c in range(len(parents)) if int(parents[c]) == cur and int(tokens[c]) == t]
        emitted.append(t)
        if d == D or not kids:
            return emitted
        cur = kids[0]
    return emitted


@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(2, 12),
    D=st.integers(1, 8),
    V=st.sampled_from([5, 37, 130]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_greedy_is_the_argmax_path(seed, T, D, V, dtype):
    case = make_case(seed, 3, T, V, D, dtype, "greedy_rows", False, False)
    logits, tokens, parents = case[:3]
    if V == 5:  # many ties among few logits: check the lowest-id rule
        case = (logits.round(),) + case[1:]
        logits = case[0]
    outs = [
        acc.accept_tree_reference(*case),
        acc.accept_tree_reference(*case, all_greedy=True),
        acc.accept_tree(*case, backend="triton", block_v=128),
    ]
    for b in range(3):
        want = _greedy_path(logits[b], tokens[b], parents[b], D)
        for out in outs:
            n = int(out.accept_len[b])
            assert out.accepted_tokens[b, : n + 1].tolist() == want
            lp = torch.log_softmax(logits[b].float(), -1)
            nodes = [0] + out.accepted_nodes[b, :n].tolist()
            expect = torch.stack([lp[c, t] for c, t in zip(nodes, want, strict=True)])
            torch.testing.assert_close(out.logprobs[b, : n + 1], expect, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- exactness, statistically
# A bigram target over V_S tokens: the distribution after token a is filtered softmax(W[a]), so the
# logits at tree node i are W[tokens[i]], and a second SD step can continue from any bonus token. Drafts
# come from a nearby bigram Q: node i's token is the rank-th best successor of its parent's token under
# Q. Node 2 repeats node 1's token (a duplicate sibling, with a child of its own).
V_S, D_S, N_DRAWS = 10, 3, 20_000
TOPOLOGY = [(-1, 0), (0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0), (5, 0)]  # (parent, rank)
STAT_CASES = [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.7, 4, 1.0), (1.0, -1, 0.8), (0.8, 6, 0.9), (1.3, -1, 0.95)]
ALPHA = 1e-3 / (2 * len(STAT_CASES))  # family-wise false-alarm rate 1e-3, Bonferroni over the tests


def _bigram_world(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V_S, V_S, generator=g, dtype=torch.float64) * 1.5
    Q = W + torch.randn(V_S, V_S, generator=g, dtype=torch.float64)
    ranked = torch.argsort(-Q, dim=1)
    table = torch.zeros(V_S, len(TOPOLOGY), dtype=torch.int64)  # [root token, node] -> token
    for r in range(V_S):
        table[r, 0] = r
        for i, (par, rank) in enumerate(TOPOLOGY[1:], start=1):
            table[r, i] = ranked[table[r, par], rank]
    return W, Q, table


def expected_probs(x, temperature, top_k, top_p):
    """Independent float64 filtered distribution: top-k largest, then the smallest prefix of the
    renormalised top-k distribution with mass >= top_p."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(-x, kind="stable")
    keep = order[: top_k if 0 < top_k < len(x) else len(x)]
    q = np.exp((x[keep] - x[keep].max()) / temperature)
    q /= q.sum()
    if top_p < 1.0:
        keep = keep[: int(np.argmax(np.cumsum(q) >= top_p)) + 1]
    p = np.zeros(len(x))
    p[keep] = np.exp((x[keep] - x[keep].max()) / temperature)
    return p / p.sum()


@pytest.mark.parametrize("params", STAT_CASES + [(0.0, 3, 0.5)])
def test_filtered_probs_match_the_definition(params):
    temperature, top_k, top_p = params
    x = torch.randn(4, 3, 50) * 2
    x[0, 0, :11] = x[0, 0].max() + 1.0  # eleven tied logits at the top
    p = filtered_probs(x, torch.full((4,), temperature), torch.full((4,), top_k), torch.full((4,), top_p))
    if temperature == 0:  # greedy rows: no filter
        top_k, top_p, temperature = -1, 1.0, 1.0
    for b, i in ((0, 0), (1, 2), (3, 1)):
        want = expected_probs(x[b, i].numpy(), temperature, top_k, top_p)
        if (b, i) != (0, 0):  # the tied row keeps all ties, which a rank-based top-k would not
            np.testing.assert_allclose(p[b, i].numpy(), want, atol=1e-6)
    assert (p[0, 0, :11] == p[0, 0, 0]).all() and p[0, 0, 0] > 0  # ties are all kept


def chi2_pvalue(counts, probs):
    """Chi-square goodness of fit; cells expecting < 5 are pooled (with the next smallest if needed)."""
    counts, probs = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    assert counts[probs <= 0].sum() == 0, "a token of zero target probability was emitted"
    n = counts.sum()
    counts, expect = counts[probs > 0], probs[probs > 0] / probs[probs > 0].sum() * n
    order = np.argsort(expect)
    counts, expect = counts[order], expect[order]
    k = int((expect < 5).sum())
    if k > 0 and expect[:k].sum() < 5:
        k += 1
    if k > 1:
        counts = np.concatenate([[counts[:k].sum()], counts[k:]])
        expect = np.concatenate([[expect[:k].sum()], expect[k:]])
    return stats.chisquare(counts, expect).pvalue


def run_sd(world, roots, params, uniforms, backend="torch", device="cpu"):
    W, _, table = world
    temperature, top_k, top_p = params
    n = len(roots)
    tokens = table[roots]
    return acc.accept_tree(
        W[tokens].float().to(device),
        tokens.to(device),
        torch.tensor([p for p, _ in TOPOLOGY]).expand(n, -1).contiguous().to(device),
        torch.full((n,), temperature, device=device),
        torch.full((n,), top_k, dtype=torch.int32, device=device),
        torch.full((n,), top_p, device=device),
        uniforms.to(device),
        D_S,
        backend=backend,
    )


def first_two_tokens(world, params, n, seed, backend="torch", device="cpu"):
    """n draws of the first two emitted tokens after root token 0 (a second SD step where the first
    step emitted only its bonus)."""
    g = torch.Generator().manual_seed(seed)
    out = run_sd(
        world, torch.zeros(n, dtype=torch.int64), params, torch.rand(n, D_S + 1, 2, generator=g), backend, device
    )
    out = type(out)(*(t.cpu() for t in out))
    first, second = out.accepted_tokens[:, 0].clone(), out.accepted_tokens[:, 1].clone()
    again = out.accept_len == 0
    out2 = run_sd(
        world, out.bonus[again], params, torch.rand(int(again.sum()), D_S + 1, 2, generator=g), backend, device
    )
    second[again] = out2.accepted_tokens[:, 0].cpu()
    return first, second, out


def expected_first_two(world, params):
    W = world[0].numpy()
    p1 = expected_probs(W[0], *params)
    return p1, p1[:, None] * np.stack([expected_probs(W[a], *params) for a in range(V_S)])


@pytest.mark.parametrize("case", range(len(STAT_CASES)), ids=[f"t{t}-k{k}-p{p}" for t, k, p in STAT_CASES])
def test_sampling_is_exact(case):
    world, params = _bigram_world(), STAT_CASES[case]
    first, second, out = first_two_tokens(world, params, N_DRAWS, seed=case)
    p1, p12 = expected_first_two(world, params)
    assert (out.accept_len >= 2).any(), "the tree was never walked two levels deep"
    assert chi2_pvalue(np.bincount(first.numpy(), minlength=V_S), p1) > ALPHA
    joint = np.bincount((first * V_S + second).numpy(), minlength=V_S * V_S)
    assert chi2_pvalue(joint, p12) > ALPHA


def test_logprobs_are_the_filtered_target_logprobs():
    world = _bigram_world()
    W = world[0].numpy()
    for params in STAT_CASES:
        _, _, out = first_two_tokens(world, params, 2_000, seed=7)
        for b in range(0, 2_000, 10):
            n = int(out.accept_len[b])
            ctx = [0] + out.accepted_tokens[b, :n].tolist()
            toks = out.accepted_tokens[b, : n + 1].tolist()
            want = [np.log(expected_probs(W[c], *params)[t]) for c, t in zip(ctx, toks, strict=True)]
            np.testing.assert_allclose(out.logprobs[b, : n + 1].numpy(), want, atol=1e-5, rtol=1e-5)


def _first_token_by_hand(p, kid_toks, accept_mass, u, exclude):
    """Vectorised first-token acceptor: scan the children with accept_mass, else inverse CDF of p
    (children removed when `exclude`)."""
    cum = np.cumsum(accept_mass)
    j = (u[:, 0, None] < cum[None, :]).argmax(1)
    took = (u[:, 0, None] < cum[None, :]).any(1)
    r = p.copy()
    if exclude:
        r[kid_toks] = 0.0
    bonus = np.minimum(np.searchsorted(np.cumsum(r / r.sum()), u[:, 1], side="right"), len(p) - 1)
    return np.where(took, np.asarray(kid_toks)[j], bonus)


def test_chi_square_catches_biased_acceptors():
    """Negative control: the same test at the same draw count rejects acceptors that scan with the draft's
    probabilities, that forget to remove the children from the bonus draw, or that let a duplicate
    sibling add its token's mass twice."""
    W, Q, table = _bigram_world()
    params = STAT_CASES[0]
    p = expected_probs(W[0].numpy(), *params)
    q = torch.softmax(Q[0], 0).numpy()
    all_kids = [int(table[0, i]) for i, (par, _) in enumerate(TOPOLOGY) if par == 0]
    kid_toks = list(dict.fromkeys(all_kids))
    assert len(kid_toks) < len(all_kids)
    u = np.random.default_rng(0).random((N_DRAWS, 2))
    fair = _first_token_by_hand(p, kid_toks, p[kid_toks], u, exclude=True)
    assert chi2_pvalue(np.bincount(fair, minlength=V_S), p) > ALPHA
    for kids, mass, exclude in (
        (kid_toks, q[kid_toks], True),
        (kid_toks, p[kid_toks], False),
        (all_kids, p[all_kids], True),
    ):
        biased = _first_token_by_hand(p, kids, mass, u, exclude)
        assert chi2_pvalue(np.bincount(biased, minlength=V_S), p) < ALPHA


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("V", [32000, 152064])
@pytest.mark.parametrize(
    "mode,top_k_on,top_p_on",
    [("all_greedy", False, False), ("mixed", False, False), ("sampled", True, True), ("sampled", False, True)],
)
def test_kernel_matches_reference_large_vocab(V, mode, top_k_on, top_p_on):
    case = make_case(11, 8, 48, V, 8, torch.bfloat16, mode, top_k_on, top_p_on, device="cuda")
    all_greedy = mode == "all_greedy"
    out_k = acc.accept_tree(*case, all_greedy=all_greedy, backend="triton")
    out_r = acc.accept_tree_reference(*case, all_greedy=all_greedy)
    assert_same_acceptance(out_k, out_r, case, all_greedy, max_diff_frac=0.25)


@pytest.mark.gpu
def test_kernel_sampling_is_exact_on_gpu():
    world = _bigram_world()
    for params in STAT_CASES[:3]:
        first, second, _ = first_two_tokens(world, params, 50_000, seed=5, backend="triton", device="cuda")
        p1, p12 = expected_first_two(world, params)
        assert chi2_pvalue(np.bincount(first.numpy(), minlength=V_S), p1) > ALPHA
        assert chi2_pvalue(np.bincount((first * V_S + second).numpy(), minlength=V_S * V_S), p12) > ALPHA
