"""Matching heads and neurons of one layer by linear assignment (scipy's solver)."""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from lmc_mergekit.models.view import MLP, Attention, ModelSpec
from lmc_mergekit.runtime.precision import native_16bit, native_int8

#: Columns per row, and rows per column, the assignment considers (besides the row's current
#: partner).
CANDIDATES = 32
#: Dimensions of the random projection a neuron assignment is proposed from (see
#: :func:`proposed_permutation`).
SKETCH_DIMS = 128


def best_permutation(
    similarity: torch.Tensor, current: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """``perm`` maximising ``Σ_i similarity[i, perm[i]]`` over the candidate graph, and that
    sum.

    Candidates are each row's :data:`CANDIDATES` most similar columns, each column's most
    similar rows (where a few columns are every row's favourites, as neurons that fire on
    every token are, the rows alone would leave the others nearly no edge, and the solver then
    searches for minutes) and each row's ``current`` partner (the identity by default):
    scipy's sparse solver (LAPJVsp) then finds the best assignment using only those edges. Up
    to ``CANDIDATES`` columns that is every edge (solved densely), hence the exact optimum;
    above, it is the optimum wherever the best partners are
    near the top (so far always, in trained pairs) and never worse than ``current``, so a
    descent that re-solves a layer cannot lose ground. Dense assignment grows as ``n³`` (15 s
    at 8192 on two cores), the candidate graph as ``n·CANDIDATES`` (under a second).
    """
    n = similarity.shape[0]
    if n <= CANDIDATES:  # every edge is a candidate: the dense solver, quicker at this size
        return dense_permutation(similarity.double())
    current = torch.arange(n) if current is None else current
    top = similarity.topk(min(n, CANDIDATES), dim=1).indices
    by_column = similarity.topk(min(n, CANDIDATES), dim=0).indices.T
    rows, cols = _candidate_edges(top, by_column, current)
    perm = _solve(n, rows, cols, similarity[rows, cols].double())
    return perm, float(similarity[torch.arange(n), perm].sum())


def _candidate_edges(
    top: torch.Tensor, by_column: torch.Tensor, current: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate graph's edges (rows, columns), each once: row ``i``'s columns
    ``top[i]``, column ``j``'s rows ``by_column[j]``, and ``(i, current[i])``."""
    n = len(top)
    index = torch.arange(n, device=top.device)
    edges = torch.cat([top, current[:, None]], dim=1) + n * index[:, None]
    by_column = by_column * n + index[:, None]
    edges = torch.unique(torch.cat([edges.reshape(-1), by_column.reshape(-1)]))
    return edges // n, edges % n


def _solve(n: int, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The permutation of the best full assignment on the edges (``values``: how much each
    is worth) by scipy's sparse solver."""
    # The solver gets whole-number costs from 1 to 2³⁰+1 (every full assignment has n edges, so
    # the shift does not change which one is best, and no cost is 0, which would read as no
    # edge): on float weights LAPJVsp can loop forever (scipy issue 17269; met here on trained
    # Gemma 2 neurons), on whole numbers below 2⁵³ its sums are exact.
    span = (values.max() - values.min()).clamp_min(1e-300)
    costs = torch.round((values.max() - values) / span * 2**30) + 1
    graph = csr_matrix((costs.numpy(), (rows.numpy(), cols.numpy())), (n, n))
    solved_rows, solved_cols = min_weight_full_bipartite_matching(graph)
    perm = torch.empty(n, dtype=torch.long)
    perm[torch.as_tensor(solved_rows).long()] = torch.as_tensor(solved_cols).long()
    return perm


def dense_permutation(similarity: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The exact ``perm`` maximising ``Σ_i similarity[i, perm[i]]`` (scipy's dense solver), and
    that maximum: for the small problems (heads, groups of heads)."""
    rows, cols = linear_sum_assignment(similarity.numpy(), maximize=True)
    perm = torch.as_tensor(cols, dtype=torch.long)
    return perm, float(similarity[torch.as_tensor(rows), perm].sum())


def match_heads(similarity: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Query-head permutation of B onto A from head similarities ``(H_A, H_B)``, GQA-aware:
    key/value groups are assigned as wholes (scored by their best within-group assignment),
    then query heads within each matched pair of groups."""
    h = similarity.shape[0]
    g = h // num_kv_heads
    blocks = similarity.reshape(num_kv_heads, g, num_kv_heads, g).permute(0, 2, 1, 3)
    inner = [
        [dense_permutation(blocks[a, b]) for b in range(num_kv_heads)] for a in range(num_kv_heads)
    ]
    group_scores = torch.tensor([[score for _, score in row] for row in inner], dtype=torch.float64)
    group_perm, _ = dense_permutation(group_scores)
    return torch.cat([int(b) * g + inner[a][int(b)][0] for a, b in enumerate(group_perm)]).long()


def head_similarity(a: Attention, b: Attention, spec: ModelSpec) -> torch.Tensor:
    """Cosine similarity of every query head of A with every one of B, summed over the QK
    circuit ``W_qᵀ·W_k`` and the OV circuit ``W_vᵀ·W_Oᵀ`` (both invariant to per-head maps)."""
    xa, ya = _query_view(a, spec, "qk")
    xb, yb = _query_view(b, spec, "qk")
    total = _circuit_cosine(xa, ya, xb, yb)
    xa, ya = _query_view(a, spec, "ov")
    xb, yb = _query_view(b, spec, "ov")
    return total + _circuit_cosine(xa, ya, xb, yb)


def neuron_similarity(a: MLP, b: MLP) -> torch.Tensor:
    """Inner products of every hidden neuron of A with every one of B over all its weights
    (one ``dff × dff`` matrix).

    Where the device multiplies int8 natively (:func:`~lmc_mergekit.runtime.precision.native_int8`)
    each neuron's weights are rounded to int8 on their largest magnitude and multiplied in
    int32, exactly: about five times float32's speed (a 7B layer's three ``dff × dff``
    products over ``d``, 3·10¹² operations, are a quarter of its weight-matching round in
    float32). Rounding moves a product by about 3 % of how far unrelated neurons' products
    spread on average (at most half of it) where one input feature is 20× the others, so the
    assignment is that of the float products (tested); elsewhere the products run in the
    parts' own dtype."""
    parts_a, parts_b = _neuron_parts(a), _neuron_parts(b)
    if native_int8(parts_a[0].device):
        (qa, scale_a), (qb, scale_b) = _int8_rows(parts_a), _int8_rows(parts_b)
        return _rescaled(torch._int_mm(qa, qb.T), scale_a, scale_b)
    sim = parts_a[0] @ parts_b[0].T
    for part_a, part_b in zip(parts_a[1:], parts_b[1:], strict=True):
        sim.addmm_(part_a, part_b.T)
    return sim


def proposed_permutation(a: MLP, b: MLP) -> torch.Tensor:
    """A permutation of B's hidden neurons onto A's, proposed from their weights projected on
    :data:`SKETCH_DIMS` random directions (seeded: the same every run): each neuron's most
    similar one where they differ, else the best assignment (:func:`best_permutation`) of the
    projections' products; ``dff²·k`` operations where
    :func:`neuron_similarity` spends ``dff²·3d`` (a fortieth at d=1536). Only a proposal:
    projected products estimate the true ones to about ``|a|·|b|/√k``, enough to find a
    partner whose weights are the neuron's own (a model and its scramble), not to rank weakly
    similar ones; weight matching keeps it only where the moved layer lands within its storage
    rounding of A."""
    parts_a, parts_b = _neuron_parts(a), _neuron_parts(b)
    width = sum(part.shape[1] for part in parts_a)
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(width, SKETCH_DIMS, generator=generator)
    directions = directions.to(parts_a[0].device, parts_a[0].dtype)

    def projected(parts: list[torch.Tensor]) -> torch.Tensor:
        out, col = None, 0
        for part in parts:
            term = part @ directions[col : col + part.shape[1]]
            out, col = term if out is None else out.add_(term), col + part.shape[1]
        return out.float()

    similarity = (projected(parts_a) @ projected(parts_b).T).cpu()
    favourite = similarity.argmax(dim=1)  # where every neuron's favourite is its own: no solve
    if len(favourite.unique()) == len(favourite):
        return favourite
    perm, _ = best_permutation(similarity)
    return perm


def _neuron_parts(mlp: MLP) -> list[torch.Tensor]:
    """A hidden neuron's weights, one ``(dff, ·)`` matrix per kind: its input rows (up, gate),
    its output column (down) and its biases."""
    parts = [mlp.up, mlp.down.T, mlp.gate, mlp.up_bias, mlp.gate_bias]
    return [p if p.dim() == 2 else p[:, None] for p in parts if p is not None]


#: Rows converted at a time (bounds the float32 temporaries to a few MB a row block).
_ROWS = 1024


def _int8_rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts side by side rounded to int8, each row on its own scale (its largest
    magnitude maps to 127), and those scales."""
    n = parts[0].shape[0]
    peak = torch.stack([p.abs().amax(dim=1).float() for p in parts]).amax(dim=0)
    scale = peak.clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.empty(n, sum(p.shape[1] for p in parts), dtype=torch.int8, device=parts[0].device)
    for rows in range(0, n, _ROWS):
        block, col = slice(rows, rows + _ROWS), 0
        for p in parts:
            q[block, col : col + p.shape[1]] = (p[block].float() / scale[block, None]).round_()
            col += p.shape[1]
    return q, scale


def _rescaled(products: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor):
    """int32 ``products`` times each row's and column's scale, as float32 in the same memory
    (a row block at a time: one ``dff × dff`` matrix, never two)."""
    out = products.view(torch.float32)
    for rows in range(0, len(products), _ROWS):
        block = slice(rows, rows + _ROWS)
        out[block] = products[block].float().mul_(scale_a[block, None]).mul_(scale_b)
    return out


def similarity_dtype(device: torch.device) -> torch.dtype:
    """The dtype the similarities that only rank heads and neurons are multiplied in: bf16
    where the device multiplies it natively (:func:`~lmc_mergekit.runtime.precision.native_16bit`:
    twice float32's speed, and a ranking needs no more digits), float32 elsewhere (a CPU
    without it emulates bf16 more slowly than it multiplies float32)."""
    return torch.bfloat16 if native_16bit(torch.bfloat16, device) else torch.float32


def circuit_blocks(attn: Attention, spec: ModelSpec, kind: str) -> tuple[torch.Tensor, ...]:
    """The row blocks a per-head map acts on, one pair per key/value head.

    ``qk``: ``X`` = the query rows of every head in the group side by side (with their bias
    column), ``Y`` = the key rows (with bias). ``ov``: ``X`` = value rows (with bias), ``Y`` = the
    transposed output columns of every head in the group. Shapes ``(Hkv, dh, n)``.
    """
    hkv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    d = attn.o.shape[0]
    if kind == "qk":
        q = _with_bias(attn.q, attn.q_bias, spec.num_heads, dh).reshape(hkv, g, dh, -1)
        x = q.permute(0, 2, 1, 3).reshape(hkv, dh, -1)
        y = _with_bias(attn.k, attn.k_bias, hkv, dh)
    else:
        x = _with_bias(attn.v, attn.v_bias, hkv, dh)
        o = attn.o.reshape(d, hkv, g, dh).permute(1, 3, 2, 0)  # (hkv, dh, g, d)
        y = o.reshape(hkv, dh, g * d)
    return x, y


def _with_bias(weight: torch.Tensor, bias: torch.Tensor | None, heads: int, dh: int):
    rows = weight.reshape(heads, dh, -1)
    if bias is None:
        return rows
    return torch.cat([rows, bias.reshape(heads, dh, 1)], dim=-1)


def _query_view(attn: Attention, spec: ModelSpec, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head ``(H, dh, n)`` blocks whose product is that head's circuit."""
    h, dh, g = spec.num_heads, spec.head_dim, spec.group_size
    group = torch.arange(h) // g
    if kind == "qk":
        x = _with_bias(attn.q, attn.q_bias, h, dh)
        y = _with_bias(attn.k, attn.k_bias, spec.num_kv_heads, dh)[group]
    else:
        x = _with_bias(attn.v, attn.v_bias, spec.num_kv_heads, dh)[group]
        y = attn.o.reshape(-1, h, dh).permute(1, 2, 0)
    return x, y


def _circuit_cosine(xa, ya, xb, yb) -> torch.Tensor:
    # <Xa_iᵀ·Ya_i, Xb_jᵀ·Yb_j>_F = Σ_ab (Xa_i·Xb_jᵀ)_ab·(Ya_i·Yb_jᵀ)_ab: only dh×dh products,
    # made in the inputs' dtype and summed in float32 at least.
    wide = torch.promote_types(xa.dtype, torch.float32)

    def product(x, y, spec: str) -> torch.Tensor:
        return torch.einsum(spec, x, y).to(wide)

    inner = (product(xa, xb, "ian,jbn->ijab") * product(ya, yb, "ian,jbn->ijab")).sum((-1, -2))
    tiny = torch.finfo(wide).tiny
    norm_a = (product(xa, xa, "ian,ibn->iab") * product(ya, ya, "ian,ibn->iab")).sum((-1, -2))
    norm_b = (product(xb, xb, "ian,ibn->iab") * product(yb, yb, "ian,ibn->iab")).sum((-1, -2))
    return inner / (norm_a.clamp_min(tiny).sqrt()[:, None] * norm_b.clamp_min(tiny).sqrt()[None, :])
