"""Translation variants the lab fits from its aligned rows.

A variant's name is its recipe, levers joined by ``+``::

    shipped                 the mapper `auto` ships today (`mappers/pretrained`), for reference
    shipped-<method>        the shipped artifact of one method (a refit is scored before `auto` ranks it)
    shipped[-<method>]+nat<m>  the same with the target's own first m layers over the context
    ridge                   one ridge map from all source layers' K and V (standardised) to every
                            target layer's K and V, full rank
    pca<r>                  the same through a shared per-token bottleneck: the top r principal
                            directions of the standardised source features (pca256, pca512, ...)
    rrr<r>                  the full ridge map reduced to rank r in its *output*: reduced-rank
                            regression, the r directions of the target's K/V the features predict
                            best (each target layer's keys and its values weighted alike), instead
                            of the r directions along which the source varies most
    +h                      the source's hidden states (every second layer) join the features
    +qw                     reduced-rank regression weighs each key channel by the energy the
                            target's own lookup queries put on it (rrr<r> only; `query_energy`):
                            the rank goes to the channels a question's logits read
    +match                  translated keys get the target's per-channel spread back (ridge shrinks
                            every channel toward its mean; the massive rotary channels suffer most)
    +ks<a>                  translated keys scaled by a (0.9-1.5): a global logit temperature
    +nat<m>                 the target's own first m layers over the context (m/L of a prefill)
    +tok, +tok<k>           a per-layer ridge from the target's own direct path of tokens t, t−1
                            (or of k tokens t … t−k+1) to what the map above still gets wrong
    +mlp<h>                 a per-layer two-layer network (hidden h) over [bottleneck, direct path of
                            t, t−1] fitted to what the map above still gets wrong (`eval/lab/nonlinear.py`)
    +cal                    a context-key logit scale per layer and head, learned by the answer NLL

One eigendecomposition of the features' covariance serves every rank and every
ridge strength: in the eigenbasis U of Cxx (eigenvalues e), the ridge map of rank r
is ``W_r(λ) = U_r diag(1/(e_r + λ)) U_rᵀ Cxy``, so a bottleneck of full rank *is*
the unconstrained ridge (tested). λ is chosen per target head on held-out
contexts, from their moments alone.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eval.lab import data
from mappers.bottleneck import direct_features, token_residual  # the runtime's own definitions

LAMBDAS = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # relative to the mean eigenvalue
WIDE_LAMBDAS = (1e-2, 3e-2, 1e-1)
HELD_OUT_FRACTION = 0.1


def is_heldout_context(ctx_id: int) -> bool:
    h = hashlib.sha256(f"lab:{ctx_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < HELD_OUT_FRACTION


# ------------------------------------------------------------ statistics

class Moments:
    """Float64 sums of x, y, xxᵀ, xyᵀ, y² over rows (train or held-out)."""

    def __init__(self, f: int, d: int) -> None:
        self.n = 0
        self.sx = torch.zeros(f, dtype=torch.float64)
        self.sy = torch.zeros(d, dtype=torch.float64)
        self.sxx = torch.zeros(f, f, dtype=torch.float64)
        self.sxy = torch.zeros(f, d, dtype=torch.float64)
        self.syy = torch.zeros(d, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.n += x.shape[0]
        self.sx += x.sum(0, dtype=torch.float64)
        self.sy += y.sum(0, dtype=torch.float64)
        self.sxx.add_(x.T @ x)               # fp32 products of one shard, summed in fp64
        self.sxy.add_(x.T @ y)
        self.syy += (y * y).sum(0, dtype=torch.float64)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}{k}": getattr(self, k) for k in ("sx", "sy", "sxx", "sxy", "syy")} | \
               {f"{prefix}n": torch.tensor(self.n)}

    @classmethod
    def from_state(cls, t: dict[str, torch.Tensor], prefix: str) -> "Moments":
        m = cls(1, 1)
        for k in ("sx", "sy", "sxx", "sxy", "syy"):
            setattr(m, k, t[f"{prefix}{k}"])
        m.n = int(t[f"{prefix}n"])
        return m


def features(shard: dict[str, torch.Tensor], hidden: bool) -> torch.Tensor:
    x = shard["xkv"].float()
    return torch.cat([x, shard["xh"].float()], -1) if hidden else x


def moments(lab: Path, hidden: bool, max_rows: int | None = None) -> tuple[Moments, Moments]:
    """Train and held-out moments over the lab's shards, cached on disk per feature set."""
    from cag.progress import Progress

    paths = data.shard_paths(lab)
    tag = ("kvh" if hidden else "kv") + f"-{len(paths)}"
    cache = lab / "stats" / f"{tag}.safetensors"
    if cache.exists():
        t = load_file(str(cache))
        return Moments.from_state(t, "train."), Moments.from_state(t, "held.")
    train = held = None
    rows = 0
    with Progress(f"lab moments {tag}", total=len(paths), unit="shards", interval_s=20) as bar:
        for path in paths:
            shard = data.read_shard(path)
            x, y = features(shard, hidden), shard["y"].float()
            if train is None:
                train, held = Moments(x.shape[1], y.shape[1]), Moments(x.shape[1], y.shape[1])
            ho = torch.tensor([is_heldout_context(int(c)) for c in shard["ctx"]])
            train.add(x[~ho], y[~ho])
            held.add(x[ho], y[ho])
            rows += x.shape[0]
            bar.advance(1)
            if max_rows and rows >= max_rows:
                break
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({**train.state("train."), **held.state("held.")}, str(cache))
    return train, held


class Standardised:
    """The train moments standardised (centred, unit variance per feature) and the held-out
    moments in the same coordinates, so a map's held-out error is exact from moments alone."""

    def __init__(self, train: Moments, held: Moments) -> None:
        n = train.n
        self.mx = train.sx / n
        self.my = train.sy / n
        # in place, rank-one updates and broadcast divisions: a wide feature set holds several
        # GB per matrix, and a temporary of each would not fit beside the moments
        cxx = train.sxx / n
        cxx.addr_(self.mx, self.mx, alpha=-1)
        self.sd = torch.diagonal(cxx).clamp_min(1e-12).sqrt()
        cxx.div_(self.sd[:, None]).div_(self.sd[None, :])
        self.cxx = cxx                                                  # fp64 [F, F]
        self.cxy = ((train.sxy / n - torch.outer(self.mx, self.my)) / self.sd[:, None]).float()
        self.tau = float(torch.diagonal(cxx).mean())                    # mean eigenvalue = tr/F
        self.train_var = (train.syy / n - self.my ** 2).float()          # [D]
        # held-out rows, centred and standardised with the *train* statistics
        m = held.n
        sx = (held.sx - m * self.mx) / self.sd
        sxx = held.sxx.clone()
        sxx.addr_(held.sx, self.mx, alpha=-1).addr_(self.mx, held.sx, alpha=-1).addr_(self.mx, self.mx, alpha=m)
        sxx.div_(self.sd[:, None]).div_(self.sd[None, :])
        self.held_sxx = sxx
        self.held_sxy = ((held.sxy - torch.outer(self.mx, held.sy)) / self.sd[:, None] - torch.outer(sx, self.my)).float()
        self.held_syy = (held.syy - 2 * self.my * held.sy + m * self.my ** 2).float()
        self.held_sst = (held.syy - held.sy ** 2 / max(m, 1)).float()


class Basis(Standardised):
    """The eigendecomposition of the standardised train covariance, and the held-out moments
    in that eigenbasis (so every rank and λ is scored exactly)."""

    full_rank_only = False

    def __init__(self, train: Moments, held: Moments, *, max_rank: int | None = None,
                 eig: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(train, held)
        cxx = self.cxx.float()
        f = cxx.shape[0]
        k = f if max_rank is None or max_rank >= f else max_rank
        if eig is not None:
            self.e, self.u = eig
        elif k == f:
            e, u = torch.linalg.eigh(self.cxx)                          # ascending
            self.e, self.u = e.flip(0).clamp_min(0).float(), u.flip(1).float()
        else:
            self.e, self.u = top_eigen(cxx, k)
        self.qty = self.u.T @ self.cxy                                  # [k, D]
        self.held_a = self.u.T @ (self.held_sxx.float() @ self.u)       # [k, k]
        self.held_b = self.u.T @ self.held_sxy                          # [k, D]
        del self.cxx, self.held_sxx, self.held_sxy                      # what the eigenbasis replaces

    @property
    def num_features(self) -> int:
        return self.u.shape[0]

    def coefficients(self, rank: int, lam: float) -> torch.Tensor:
        """``[r, D]``: the map in the eigenbasis, G·Qᵀ (so W = U_r · coefficients)."""
        g = 1.0 / (self.e[:rank] + lam * self.tau)
        return g[:, None] * self.qty[:rank]

    def heldout_sse(self, coef: torch.Tensor) -> torch.Tensor:
        r = coef.shape[0]
        return self.held_syy - 2 * (self.held_b[:r] * coef).sum(0) + ((self.held_a[:r, :r] @ coef) * coef).sum(0)

    def predicted_var(self, coef: torch.Tensor) -> torch.Tensor:
        r = coef.shape[0]
        return (self.e[:r, None] * coef * coef).sum(0)

    def fitted_cov(self, coef: torch.Tensor) -> torch.Tensor:
        """``coefᵀ Cxx coef`` ``[D, D]``: the train covariance of the map's fitted values."""
        return (coef.T * self.e[None, : coef.shape[0]]) @ coef

    def to_features(self, coef: torch.Tensor) -> torch.Tensor:
        """A map in this basis as a map from the standardised features ``[F, ·]``."""
        return self.u[:, : coef.shape[0]] @ coef


class WideBasis(Standardised):
    """`Basis`'s interface in the standardised feature coordinates themselves, for feature sets
    too wide to eigendecompose here in minutes: with the source's hidden states beside its
    K/V (20,160 features) a full eigendecomposition takes about half an hour on two cores.
    Only the full-rank ridge is offered, one Cholesky solve per λ; reduced-rank regression
    then compresses its output."""

    full_rank_only = True

    def __init__(self, train: Moments, held: Moments) -> None:
        super().__init__(train, held)
        self.held_a = self.held_sxx.float()
        self.held_b = self.held_sxy
        del self.held_sxx, self.held_sxy
        self._cxx32 = self.cxx.float()

    @property
    def num_features(self) -> int:
        return self.cxy.shape[0]

    def coefficients(self, rank: int, lam: float) -> torch.Tensor:
        if rank != self.num_features:
            raise ValueError("a wide basis fits the full-rank ridge only (then reduced-rank regression)")
        a = self.cxx.clone()
        a.diagonal().add_(lam * self.tau)
        chol = torch.linalg.cholesky(a)                     # fp64: the covariance is ill-conditioned
        del a
        return torch.cholesky_solve(self.cxy, chol.float())  # the solve in fp32 (twice as fast here)

    def heldout_sse(self, coef: torch.Tensor) -> torch.Tensor:
        return self.held_syy - 2 * (self.held_b * coef).sum(0) + ((self.held_a @ coef) * coef).sum(0)

    def predicted_var(self, coef: torch.Tensor) -> torch.Tensor:
        return ((self._cxx32 @ coef) * coef).sum(0)

    def fitted_cov(self, coef: torch.Tensor) -> torch.Tensor:
        return coef.T @ (self._cxx32 @ coef)

    def to_features(self, coef: torch.Tensor) -> torch.Tensor:
        return coef


def top_eigen(a: torch.Tensor, k: int, oversample: int = 64, power: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k eigenpairs of a symmetric PSD matrix by randomized subspace iteration
    (Halko et al.): a full eigendecomposition of an 11,520-wide covariance takes
    minutes on two cores, the top 1,024 directions seconds."""
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(a @ torch.randn(a.shape[0], k + oversample, generator=g))[0]
    for _ in range(power):
        q = torch.linalg.qr(a @ q)[0]
    e, v = torch.linalg.eigh((q.T @ a @ q).double())
    e, v = e.flip(0)[:k].clamp_min(0).float(), v.flip(1)[:, :k].float()
    return e, q @ v


MAX_RANK = 1024  # the widest bottleneck the lab fits on real features
_BASES: dict[tuple[str, bool, bool], tuple[Basis, int]] = {}


def basis_for(lab: Path, hidden: bool, *, full: bool = False) -> tuple[Basis | WideBasis, int]:
    """The eigenbasis of the lab's features: the top `MAX_RANK` directions, or all of them
    (`full`, for the unconstrained ridge and reduced-rank regression; its eigendecomposition
    takes minutes, so it is cached beside the moments). With hidden states, `full` is a
    `WideBasis` (Cholesky solves, no eigendecomposition)."""
    key = (str(lab), hidden, full)
    if key not in _BASES:
        train, held = moments(lab, hidden)
        if full and hidden:
            basis = WideBasis(train, held)
        else:
            basis = _full_basis(lab, hidden, train, held) if full else Basis(train, held, max_rank=MAX_RANK)
        _BASES[key] = (basis, train.n)
        del train, held
    return _BASES[key]


def _full_basis(lab: Path, hidden: bool, train: Moments, held: Moments) -> Basis:
    cache = lab / "stats" / f"{'kvh' if hidden else 'kv'}-{len(data.shard_paths(lab))}.eigh.safetensors"
    if cache.exists():
        t = load_file(str(cache))
        return Basis(train, held, eig=(t["e"], t["u"]))
    basis = Basis(train, held)
    save_file({"e": basis.e.contiguous(), "u": basis.u.contiguous()}, str(cache))
    return basis


def fit_cache(lab: Path, kind: str, name: str) -> Path:
    """Where a fitted lever's weights are cached: keyed by the lab's shard count, so a lab grown by a
    longer `build` never reuses a fit of fewer rows."""
    return lab / kind / f"{name}@{len(data.shard_paths(lab))}shards.safetensors"


# --------------------------------------------------------------- variants

class Variant:
    """Features of one item → the target's K and V ``[L, H, T, D]``."""

    train_rows = 0

    def describe(self) -> str:
        return ""

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def translate_rows(self, item: dict, target, ids: torch.Tensor, pos: torch.Tensor):
        """`translate` of a lab context's training rows: ``ids`` are the context's target tokens and
        ``pos`` the rows' positions among them (what a token-level lever reads)."""
        return self.translate(item, target)


class LinearVariant(Variant):
    def __init__(self, basis: Basis, train_rows: int, head_dim: int, *, rank: int | None, hidden: bool,
                 match: bool, key_scale: float, native_layers: int, output_rank: int | None = None,
                 num_layers: int | None = None, key_energy: torch.Tensor | None = None) -> None:
        self.train_rows = train_rows
        f, d = basis.num_features, basis.cxy.shape[1]
        held = f if basis.full_rank_only else basis.u.shape[1]
        if rank is None and held < f:
            raise ValueError(f"full-rank ridge needs the full eigenbasis; this one holds {held} directions")
        if basis.full_rank_only and (rank is not None or output_rank is None):
            raise ValueError("a wide feature set is fitted as reduced-rank regression only (rrr<r>)")
        self.rank = min(rank or f, held)
        dt = head_dim
        best_sse = torch.full((d // dt,), float("inf"))
        coef = torch.zeros(self.rank, d)
        self.lambdas = [0.0] * (d // dt)
        # λ per target head (and layer, and kind), on held-out contexts; a wide basis pays a
        # Cholesky solve per λ, so it tries the middle of the grid, where every K/V fit chose
        for lam in (WIDE_LAMBDAS if basis.full_rank_only else LAMBDAS):
            c = basis.coefficients(self.rank, lam)
            sse = basis.heldout_sse(c).reshape(-1, dt).sum(-1)
            better = sse < best_sse
            best_sse = torch.where(better, sse, best_sse)
            cols = better.repeat_interleave(dt)
            coef[:, cols] = c[:, cols]
            self.lambdas = [lam if b else old for b, old in zip(better.tolist(), self.lambdas)]
        self.output_rank = output_rank
        if output_rank is None:
            self.proj = basis.u[:, : self.rank].contiguous()         # [F, r]: the shared bottleneck
            self.coef = coef                                          # [r, D]
        else:
            coef, self.proj, self.coef = reduce_rank(basis, coef, output_rank,
                                                     output_weights(basis, num_layers, key_energy))
            best_sse = basis.heldout_sse(coef).reshape(-1, dt).sum(-1)
        self.heldout_r2 = float(1 - best_sse.sum() / basis.held_sst.sum())
        self.mx, self.sd, self.my = basis.mx.float(), basis.sd.float(), basis.my.float()
        self.hidden, self.match, self.key_scale, self.native_layers = hidden, match, key_scale, native_layers
        self.query_weighted = key_energy is not None
        self.scale = torch.ones(d)
        if match:  # per output column: the target's spread over the prediction's, keys only
            ratio = (basis.train_var / basis.predicted_var(coef).clamp_min(1e-12)).sqrt()
            self.scale[: d // 2] = ratio[: d // 2]
        self.scale[: d // 2] *= key_scale

    def describe(self) -> str:
        rank = (f"reduced-rank regression to rank {self.output_rank} (of the full ridge)" if self.output_rank
                else f"rank {self.rank}")
        return (f"{rank}, features {'K,V,hidden' if self.hidden else 'K,V'} of all source layers, "
                f"held-out R² {self.heldout_r2:.3f}, λ median {sorted(self.lambdas)[len(self.lambdas) // 2]:g}"
                + (", key channels weighted by the target's lookup queries" if self.query_weighted else "")
                + (", keys spread-matched" if self.match else "")
                + (f", keys ×{self.key_scale:g}" if self.key_scale != 1 else "")
                + (f", first {self.native_layers} target layers native" if self.native_layers else ""))

    def bottleneck(self, item: dict) -> torch.Tensor:
        """``[T, r]``: the item's rows in the map's bottleneck coordinates."""
        return ((features(item, self.hidden) - self.mx) / self.sd) @ self.proj

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        y = (self.bottleneck(item) @ self.coef) * self.scale + self.my
        y[~item["has_source"]] = self.my
        fp = target.fingerprint
        keys, values = data.split_target(y, fp.num_layers, fp.num_kv_heads)
        return with_native_first(keys, values, item, self.native_layers)


def output_weights(basis: Basis, num_layers: int, key_energy: torch.Tensor | None = None) -> torch.Tensor:
    """``[D]`` column weights for reduced-rank regression: each target layer's keys, and its
    values, carry equal total weight. Raw squared error would hand the rank to the keys'
    massive channels and starve the values, which carry the token identity a lookup copies.

    `key_energy` ``[L·H·D]`` (`query_energy`): within each layer's keys, a channel's error counts
    in proportion to E[q²] of the queries that read it, the error a logit ``q·k`` sees; the
    layer's keys keep the same total weight."""
    var = basis.train_var.clamp_min(1e-12).reshape(2, num_layers, -1)
    w2 = var.mean(-1, keepdim=True).reciprocal().expand_as(var).clone()        # squared weights
    if key_energy is not None:
        e = key_energy.reshape(num_layers, -1).clamp_min(1e-12)
        w2[0] = e * var.shape[-1] / (e * var[0]).sum(-1, keepdim=True)
    return w2.sqrt().reshape(-1)


def query_energy(lab: Path, target, n: int = 16) -> torch.Tensor:
    """``[L·H·D]``: E[q²] per key channel (the target's de-rotated layout) of the target's own
    queries at the question tokens of the lab's `tune` lookups, read with direct context.

    Rotary position turns each channel pair (c, c + D/2) by the query-key distance, so over
    many distances a pair's error meets the pair's query energy, not a channel's: both channels
    get the pair's mean. Query heads sharing a KV head are averaged. Cached in the lab's stats."""
    from cag.assembler import Assembler
    from cag.models.attention import capture_attention
    from cag.prompt import layout_for

    cache = lab / "stats" / f"query_energy-tune{n}.safetensors"
    if cache.exists():
        return load_file(str(cache))["energy"]
    asm = Assembler(target, layout_for(target.tokenizer))
    fp = target.fingerprint
    total = torch.zeros(fp.num_layers, fp.num_kv_heads, fp.head_dim // 2, dtype=torch.float64)
    count = 0
    for item in data.lookup_items("tune", n):
        question = asm.question_ids(item.question)
        ids = asm.direct_ids([target.tokenize(item.documents[0].text)[0]], item.question)
        store: dict = {}
        with torch.inference_mode(), capture_attention(target.model, store):
            target.model.model(input_ids=ids[None])
        for layer, (q, *_rest) in store.items():
            q = q[:, -question.numel():].double()                                # [Hq, Tq, D]
            pair = q[..., : fp.head_dim // 2] ** 2 + q[..., fp.head_dim // 2:] ** 2
            total[layer] += pair.reshape(fp.num_kv_heads, -1, *pair.shape[1:]).sum((1, 2))
        count += question.numel() * (store[0][0].shape[0] // fp.num_kv_heads)  # query heads per KV head
    energy = (total / (2 * count)).repeat(1, 1, 2).float().reshape(-1).contiguous()
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({"energy": energy}, str(cache))
    return energy


def reduce_rank(basis: Basis, coef: torch.Tensor, r: int,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduced-rank regression of a full-rank ridge map (``coef`` ``[F, D]`` in the eigenbasis).

    The rank-r map with the least weighted error on the training rows is the ridge map
    projected onto the top r eigenvectors V of the weighted fitted covariance
    ``Ω coefᵀ diag(e) coef Ω`` (Eckart-Young on the fitted values). Returns the map in the
    eigenbasis (for held-out SSE and spread), and its factors in the runtime's form:
    ``proj`` ``[F, r]`` (standardised features → bottleneck) and ``out`` ``[r, D]``."""
    wc = coef * weights[None, :]
    fitted = basis.fitted_cov(wc)                                           # [D, D]
    _, v = torch.linalg.eigh(fitted.double())
    v = v.flip(1)[:, :r].float()                                            # [D, r]
    inner = wc @ v                                                          # [F, r]
    out = v.T / weights[None, :]                                            # [r, D]
    return inner @ out, basis.to_features(inner).contiguous(), out.contiguous()


def with_native_first(keys: torch.Tensor, values: torch.Tensor, item: dict, m: int):
    """The target's own first `m` layers of the item's chunk in place of the translated ones (`+nat<m>`)."""
    if m:
        keys[:m], values[:m] = item["native_keys"][:m], item["native_values"][:m]
    return keys, values


class ShippedVariant(Variant):
    """What `mapper="auto"` (or one shipped method) translates the source's own chunk with."""

    def __init__(self, source, target, method: str = "auto", native_layers: int = 0) -> None:
        from cag.mapping import resolve_mapper

        self.source, self.asked, self.native_layers = source, method, native_layers
        self.mapper = resolve_mapper(method, source.fingerprint, target)

    def describe(self) -> str:
        return (f"shipped {self.asked} mapper: {self.mapper.method} ({self.mapper.artifact_id})"
                + (f", first {self.native_layers} target layers native" if self.native_layers else ""))

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.source.prefill(item["text"])
        out = self.mapper.translate(chunk, item["text"], target)
        return with_native_first(out.keys.float(), out.values.float(), item, self.native_layers)


TOK_LAMBDAS = (1e-2, 1e-1, 1.0)


class TokenResidualVariant(Variant):
    """A linear variant plus, per target layer, a ridge map from the target's direct path of tokens
    t and t−1 to what the variant still gets wrong (fitted on its residuals over the lab's rows)."""

    def __init__(self, base: "LinearVariant", base_name: str, lab: Path, source, target, window: int = 2) -> None:
        from safetensors.torch import load_file, save_file

        self.base, self.train_rows, self.window = base, base.train_rows, window
        path = fit_cache(lab, "token_residual", base_name if window == 2 else f"{base_name}.w{window}")
        if path.exists():
            t = load_file(str(path))
        else:
            t = fit_token_residual(base, lab, source, target, window)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(t, str(path))
        self.w, self.mean_f, self.mean_r, self.sse_drop = t["w"], t["mean_f"], t["mean_r"], float(t["sse_drop"])

    def describe(self) -> str:
        return (f"{self.base.describe()}, + target-token residual per layer, tokens t…t−{self.window - 1} "
                f"(held-out error −{100 * self.sse_drop:.1f}%)")

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.base.translate(item, target)
        rk, rv = token_residual(target, item["token_ids"], self.w, self.mean_f, self.mean_r)
        m = self.base.native_layers
        if m:
            rk[:m], rv[:m] = 0, 0
        return keys + rk, values + rv

    def translate_rows(self, item: dict, target, ids: torch.Tensor, pos: torch.Tensor):
        keys, values = self.base.translate(item, target)  # training rows hold no native layers
        rk, rv = token_residual(target, ids, self.w, self.mean_f, self.mean_r)   # over the whole text
        return keys + rk[:, :, pos], values + rv[:, :, pos]


def _context_rows(source, target, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target token ids of a context's rows (as `data.build_shards` kept them) and their positions."""
    chunk_offsets = source.tokenize(text)[1]
    ids, offsets = target.tokenize(text)
    from mappers.token_alignment import align_tokens

    ok = align_tokens(chunk_offsets, offsets, window=1).has_source
    return ids, ok.nonzero().flatten()


def context_rows(lab: Path, source, target, label: str):
    """Per lab context, in shard order: its id, its rows as a translatable item, the target's K/V rows
    ``(keys, values)`` ``[L, H, T', D]``, the context's target token ids and the rows' positions among
    them. Each text is checked against its recorded hash (a changed corpus means a rebuild)."""
    from cag.progress import Progress

    fp = target.fingerprint
    texts = {c["id"]: c["text"] for c in data.training_corpus()}
    recorded = {c["id"]: c["sha256"] for c in json.loads((lab / "corpus.json").read_text())}
    paths = data.shard_paths(lab)
    with Progress(label, total=len(paths), unit="shards", interval_s=20) as bar:
        for path in paths:
            shard = data.read_shard(path)
            for ctx in json.loads(data.load_meta(path)["contexts"]):
                text = texts[ctx]
                if hashlib.sha256(text.encode()).hexdigest() != recorded[ctx]:
                    raise ValueError(f"lab context {ctx} no longer reproduces its recorded text; rebuild the lab")
                rows = shard["ctx"] == ctx
                ids, pos = _context_rows(source, target, text)
                item = {"xkv": shard["xkv"][rows], "xh": shard["xh"][rows],
                        "has_source": torch.ones(int(rows.sum()), dtype=torch.bool)}
                yield ctx, item, data.split_target(shard["y"][rows].float(), fp.num_layers, fp.num_kv_heads), ids, pos
            bar.advance(1)


def residual_rows(y: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[L, T', 2·H·D]``: what a translation still gets wrong, per layer (keys, then values)."""
    L, hd = keys.shape[0], keys.shape[1] * keys.shape[3]
    return torch.cat([(y[0] - keys).permute(0, 2, 1, 3).reshape(L, -1, hd),
                      (y[1] - values).permute(0, 2, 1, 3).reshape(L, -1, hd)], -1)


def fit_token_residual(base: "LinearVariant", lab: Path, source, target, window: int = 2) -> dict[str, torch.Tensor]:
    fp = target.fingerprint
    L, hd = fp.num_layers, fp.num_kv_heads * fp.head_dim
    f_dim = 2 * window * hd
    stats = {split: {"ff": torch.zeros(L, f_dim, f_dim, dtype=torch.float64),
                     "fr": torch.zeros(L, f_dim, 2 * hd, dtype=torch.float64),
                     "f": torch.zeros(L, f_dim, dtype=torch.float64), "r": torch.zeros(L, 2 * hd, dtype=torch.float64),
                     "rr": torch.zeros(L, 2 * hd, dtype=torch.float64), "n": 0} for split in ("train", "held")}
    for ctx, item, y, ids, pos in context_rows(lab, source, target, "lab token residual"):
        keys, values = base.translate(item, target)                                      # [L, H, T', D]
        res = residual_rows(y, keys, values)                                             # [L, T', 2HD]
        f = direct_features(target, ids, window)[:, pos]                                # [L, T', window·2HD]
        st = stats["held" if is_heldout_context(ctx) else "train"]
        st["ff"] += torch.bmm(f.transpose(1, 2), f).double()
        st["fr"] += torch.bmm(f.transpose(1, 2), res).double()
        st["f"] += f.sum(1).double()
        st["r"] += res.sum(1).double()
        st["rr"] += (res * res).sum(1).double()
        st["n"] += f.shape[1]
    tr, ho = stats["train"], stats["held"]
    n = tr["n"]
    mf, mr = tr["f"] / n, tr["r"] / n
    cff = tr["ff"] / n - mf[:, :, None] * mf[:, None, :]
    cfr = tr["fr"] / n - mf[:, :, None] * mr[:, None, :]
    tau = torch.diagonal(cff, dim1=1, dim2=2).mean(-1)                                       # [L]
    best_w, best_sse = None, None
    eye = torch.eye(f_dim, dtype=torch.float64)
    m = ho["n"]
    # held-out error of predicting the residual r by (f − mf)·W, from the held-out moments
    hff = ho["ff"] - mf[:, :, None] * ho["f"][:, None, :] - ho["f"][:, :, None] * mf[:, None, :] \
        + m * mf[:, :, None] * mf[:, None, :]
    hfr = ho["fr"] - mf[:, :, None] * ho["r"][:, None, :]
    for lam in TOK_LAMBDAS:
        w = torch.linalg.solve(cff + lam * tau[:, None, None] * eye, cfr)                       # [L, F, 2HD]
        sse = ho["rr"] - 2 * (hfr * w).sum(1) + (torch.bmm(hff, w) * w).sum(1)                   # [L, 2HD]
        if best_sse is None:
            best_w, best_sse = w.clone(), sse
        else:
            better = (sse.sum(-1) < best_sse.sum(-1))                                          # per layer
            best_w[better], best_sse[better] = w[better], sse[better]
    base_sse = ho["rr"].sum()  # the base variant's own held-out squared error
    drop = float((base_sse - best_sse.sum()) / base_sse)
    return {"w": best_w.float().contiguous(), "mean_f": mf.float().contiguous(), "mean_r": mr.float().contiguous(),
            "sse_drop": torch.tensor(drop)}


class CalibratedVariant(Variant):
    """A variant whose context keys get a learned per-(layer, head) logit scale (`eval.lab.calibrate`),
    fitted on the lab's *tune* lookup items and cached on disk."""

    def __init__(self, base: Variant, base_name: str, lab: Path, target) -> None:
        from safetensors.torch import load_file, save_file

        self.base, self.train_rows = base, base.train_rows
        path = fit_cache(lab, "calibration", base_name)
        if path.exists():
            t = load_file(str(path))
            self.log_scale, self.history = t["log_scale"], t["history"].tolist()
        else:
            from cag.progress import Progress
            from eval.lab import calibrate
            from eval.lab.score import Scorer, load_item

            scorer = Scorer(target)
            items = [load_item(p) for p in sorted((lab / "items" / "tune").glob("*.safetensors"))]
            epochs = 6

            def translate(item):
                return scorer.chunk(item, *base.translate(item, target))

            with Progress("lab calibrate", total=len(items) * (epochs + 1), unit="steps", interval_s=20) as bar:
                self.log_scale, self.history = calibrate.fit_log_scales(target, items, translate, epochs=epochs,
                                                                        progress=bar)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"log_scale": self.log_scale.contiguous(), "history": torch.tensor(self.history)}, str(path))

    def describe(self) -> str:
        s = torch.exp(self.log_scale)
        return (f"{self.base.describe()}, context-key logit scale per layer and head learned on tune items "
                f"(×{float(s.min()):.2f}-{float(s.max()):.2f}; tune NLL {self.history[0]:.2f} → {self.history[-1]:.2f})")

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.base.translate(item, target)
        return keys * torch.exp(self.log_scale)[:, :, None, None], values


_LEVER = re.compile(r"^(h|qw|match|ks[0-9.]+|nat[0-9]+|tok[0-9]*|mlp[0-9]+|cal)$")


def make(name: str, lab: Path, source, target) -> Variant:
    if name == "shipped" or name.startswith(("shipped-", "shipped+")):
        shipped, *levers = name.split("+")
        if any(not re.fullmatch(r"nat[0-9]+", lv) for lv in levers):
            raise ValueError(f"a shipped mapper takes only +nat<m> (in {name!r})")
        native = next((int(lv[3:]) for lv in levers), 0)
        if not 0 <= native <= target.fingerprint.num_layers:
            raise ValueError(f"+nat{native}: {target.fingerprint.num_layers} target layers (in {name!r})")
        return ShippedVariant(source, target, shipped.split("-", 1)[1] if "-" in shipped else "auto", native)
    base, *levers = name.split("+")
    rank = output_rank = None
    if re.fullmatch(r"pca[0-9]+", base):
        rank = int(base[3:])
    elif re.fullmatch(r"rrr[0-9]+", base):
        output_rank = int(base[3:])
    elif base != "ridge":
        raise ValueError(f"unknown variant base {base!r} (shipped, ridge, pca<r>, rrr<r>)")
    bad = [lever for lever in levers if not _LEVER.match(lever)]
    if bad:
        raise ValueError(f"unknown levers {bad} in {name!r}")
    if any(lv.startswith("nat") for lv in levers) and any(lv.startswith("tok") for lv in levers):
        # The token residual is fitted on the training rows, which hold no native chunk to put in the
        # first m layers: the two levers have never been fitted together.
        raise ValueError(f"+nat<m> and +tok do not combine (in {name!r}): the token residual's rows have no "
                         "native layers")
    if any(lv.startswith("nat") for lv in levers) and any(lv.startswith("mlp") for lv in levers):
        raise ValueError(f"+nat<m> and +mlp do not combine (in {name!r}): the network's rows have no native layers")
    if "qw" in levers and output_rank is None:
        raise ValueError(f"+qw weighs reduced-rank regression's output; it needs rrr<r> (in {name!r})")
    key_scale = next((float(lv[2:]) for lv in levers if lv.startswith("ks")), 1.0)
    native = next((int(lv[3:]) for lv in levers if lv.startswith("nat")), 0)
    basis, rows = basis_for(lab, "h" in levers, full=rank is None)
    variant = LinearVariant(basis, rows, target.fingerprint.head_dim, rank=rank, hidden="h" in levers,
                            match="match" in levers, key_scale=key_scale, native_layers=native,
                            output_rank=output_rank, num_layers=target.fingerprint.num_layers,
                            key_energy=query_energy(lab, target) if "qw" in levers else None)
    # Each wrapping lever is fitted on (and its fit cached under the name of) the levers applied before it.
    tok = next((lv for lv in levers if lv.startswith("tok")), None)
    mlp = next((lv for lv in levers if lv.startswith("mlp")), None)
    name_without = lambda *drop: "+".join(lv for lv in [base, *levers] if lv not in drop)  # noqa: E731
    if tok:  # tok = tokens t, t−1; tok<k> = a window of k tokens
        variant = TokenResidualVariant(variant, name_without(tok, mlp, "cal"), lab, source, target,
                                       window=int(tok[3:] or 2))
    if mlp:
        from eval.lab.nonlinear import MLPResidualVariant

        variant = MLPResidualVariant(variant, name_without(mlp, "cal"), lab, source, target, hidden=int(mlp[3:]))
    if "cal" in levers:
        variant = CalibratedVariant(variant, name_without("cal"), lab, target)
    return variant


def to_mapper(variant, source, target):
    """The runtime `BottleneckMapper` of a fitted linear variant (standardisation, spread and any
    learned per-head key scale folded in)."""
    from mappers.bottleneck import BottleneckMapper

    log_scale = tok = None
    if isinstance(variant, CalibratedVariant):
        variant, log_scale = variant.base, variant.log_scale
    if isinstance(variant, TokenResidualVariant):
        variant, tok = variant.base, variant

    if variant.hidden or variant.native_layers:
        raise ValueError("only K,V-feature variants without native layers map to the runtime bottleneck")
    sd = variant.sd
    mapper = BottleneckMapper(source.fingerprint, target.fingerprint,
                              {"rank": variant.proj.shape[1], "token_residual": tok is not None,
                               **({"token_window": tok.window} if tok is not None else {})})
    fp = target.fingerprint
    coef, y_mean = variant.coef * variant.scale[None, :], variant.my
    extra = {}
    if tok is not None:
        extra = {"tok_w": tok.w.clone(), "tok_mean_f": tok.mean_f.clone(), "tok_mean_r": tok.mean_r.clone()}
    if log_scale is not None:  # the learned scale multiplies whole keys: base map and token residual alike
        from eval.lab.calibrate import fold_into

        coef, y_mean = fold_into(coef, y_mean, log_scale, fp.head_dim)
        if tok is not None:
            hd = fp.num_kv_heads * fp.head_dim
            per_layer = torch.exp(log_scale).repeat_interleave(fp.head_dim, dim=1)       # [L, H·D]
            extra["tok_w"][:, :, :hd] *= per_layer[:, None, :]
            extra["tok_mean_r"][:, :hd] *= per_layer
    mapper.set_weights(proj=variant.proj / sd[:, None], bias=-(variant.mx / sd) @ variant.proj,
                       coef=coef, y_mean=y_mean, **extra)
    mapper.fitted_on = {"train_rows": variant.train_rows,
                        "prefill_prefix": {"source": source.prefill_prefix, "target": target.prefill_prefix},
                        "lambdas_per_head": variant.lambdas, "spread_matched": variant.match,
                        "key_scale": variant.key_scale}
    mapper.fidelity = {"heldout": {"r2": variant.heldout_r2,
                                   **({"token_residual_sse_drop": tok.sse_drop} if tok is not None else {})}}
    return mapper


def lab_provenance(lab: Path) -> dict:
    """Which of the lab's recorded contexts the rows came from (for a mapper card)."""
    corpus = json.loads((lab / "corpus.json").read_text())
    used = sorted({int(c) for p in data.shard_paths(lab) for c in json.loads(data.load_meta(p)["contexts"])})
    return {"corpus": "translation lab (eval/lab/data.py): calibration essays, installed package descriptions, "
                      "calib-lookup seeds >= 100, calib-needle seeds >= 100",
            "contexts": len(used),
            "contexts_sha256": hashlib.sha256("".join(corpus[i]["sha256"] for i in used).encode()).hexdigest()}
