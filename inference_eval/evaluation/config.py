"""Typed configs of `python -m inference_eval` (conf/eval.yaml).

    draft:   one DraftConfig, chosen from conf/draft/{none,head,llm}.yaml (`draft=head ...`)
    drafts:  several drafts side by side in one report; each entry is a preset name or a
             mapping of DraftConfig fields whose `kind` (or `preset`) picks the preset it
             starts from, e.g.
             drafts='[{kind:head,checkpoint:runs/mtp,name:mtp},{kind:llm,name:small}]'
             A non-empty `drafts` replaces `draft`. The AR baseline always runs first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference_eval.engine.config import EngineConfig
from inference_eval.hydra_app import CONF_DIR
from inference_eval.evaluation.prompts import PromptsConfig
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.draft_cut import DraftCut
from inference_eval.engine.target import TargetConfig

DRAFT_KINDS = ("none", "head", "llm", "lookup")
SCHEMES = ("chain", "tree")
BASELINE_LABEL = "ar"


@dataclass
class DraftConfig:
    """The `draft` group: what proposes tokens for the target to verify.

    kind: none (autoregressive baseline) | head (a trained head checkpoint dir) | llm (a
        separate small model `llm`, sharing the target's tokenizer) | lookup (n-gram lookup
        only: no model drafts).
    lookup: head / llm chains: n-gram lookup drafts first (engine/speculative/lookup.py);
        rounds it finds nothing for draft `model_draft` tokens from the model (None: num_draft).
        kind=lookup implies it. lookup_corpus: precompute shard dirs ('a,b') whose answer
        tokens (the loss mask) become the corpus n-gram table (None: the request's own
        context only); lookup_min_match / lookup_max_match: the context n-gram lengths
        tried, longest first.
    scheme: chain (num_draft tokens in a line) | tree (EAGLE-2 dynamic tree: `topk` children
        per expanded node, `depth` levels, `total_tokens` kept after pruning).
    name: label in the report (None = derived from checkpoint/llm name and scheme).
    """

    kind: str = "none"
    name: str | None = None
    checkpoint: str | None = None
    scheme: str = "chain"
    num_draft: int = 4
    # EAGLE-2's published defaults (top_k 10, depth 5, total_token 60).
    topk: int = 10
    depth: int = 5
    total_tokens: int = 60
    llm: TargetConfig | None = None
    # Head chains: the head catches up on the verify pass's layout before the host learns the
    # accepted length, so a round needs no device-to-host read before the next draft
    # (engine/speculative/drafters.py).
    sync_free: bool = False
    lookup: bool = False
    lookup_corpus: str | None = None
    lookup_min_match: int = 2
    lookup_max_match: int = 8
    model_draft: int | None = None
    # Chains: a request stops drafting at the first draft whose law puts less than this on its
    # most likely token (0: always num_draft); EAGLE-2's confidence cut, for a line.
    min_confidence: float = 0.0
    # What min_confidence is compared with: "draft", each draft's own confidence; "prefix",
    # the product of the round's confidences up to this draft (the estimated chance that all
    # of them are accepted, SpecDec++'s stopping rule). "rate" (DSpark's scheduler) needs no
    # threshold: a draft is kept while it raises the round's expected tokens per cost, from
    # round_costs (num_draft + 1 numbers: a round verifying 0..num_draft drafts, in AR steps;
    # scripts/bench_spec.py --steps-only prints them) and the drafts' calibrated confidences
    # (engine/speculative/draft_cut.py).
    confidence_cut: str = "draft"
    round_costs: list[float] | None = None

    def __post_init__(self) -> None:
        if self.kind == "lookup":
            self.lookup = True
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"draft.kind={self.kind!r}: use one of {DRAFT_KINDS}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"draft.scheme={self.scheme!r}: use one of {SCHEMES}")
        for key in ("num_draft", "topk", "depth", "total_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"draft.{key} must be an integer >= 1, got {value!r}")
        if self.kind == "head" and not self.checkpoint:
            raise ValueError("draft.checkpoint is required with draft=head (a head checkpoint dir)")
        if self.kind == "llm" and self.llm is None:
            raise ValueError("draft.llm (a target-like config of the draft model) is required "
                             "with draft=llm")
        if self.sync_free and (self.kind != "head" or self.scheme != "chain"):
            raise ValueError("draft.sync_free applies to head chains (draft=head, "
                             f"scheme=chain), not kind={self.kind} scheme={self.scheme}")
        if self.lookup and self.kind == "none":
            raise ValueError("draft.lookup=true needs a drafter behind it: kind=head or llm, or "
                             "kind=lookup for lookup alone (kind=none is the baseline)")
        if self.lookup and self.scheme != "chain":
            raise ValueError("draft.lookup drafts chains: use scheme=chain (an EAGLE-2 tree "
                             "grows from one model's top-k, which lookup does not have)")
        if not 1 <= self.lookup_min_match <= self.lookup_max_match:
            raise ValueError("draft.lookup_min_match / lookup_max_match must satisfy 1 <= min <= "
                             f"max, got {self.lookup_min_match} / {self.lookup_max_match}")
        if self.model_draft is not None and (not self.lookup or self.kind == "lookup"
                                             or self.model_draft < 1):
            raise ValueError(f"draft.model_draft={self.model_draft!r}: an integer >= 1, for head or "
                             "llm chains with lookup=true (the model's drafts where lookup has none)")
        if self.lookup_corpus is not None and not self.lookup:
            raise ValueError("draft.lookup_corpus needs lookup=true (or kind=lookup)")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"draft.min_confidence={self.min_confidence!r}: a probability in "
                             "[0, 1) (0 drafts num_draft tokens every round)")
        cuts = self.min_confidence > 0 or self.confidence_cut == "rate"
        if cuts and (self.scheme != "chain" or self.kind in ("none", "lookup")):
            raise ValueError("draft.min_confidence and confidence_cut=rate cut model-drafted "
                             "chains: use them with draft=head or llm and scheme=chain (a tree "
                             "prunes by its own scores)")
        DraftCut(self.confidence_cut, self.min_confidence, self.round_costs, self.num_draft)
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"draft.name must be a non-empty string or null, got {self.name!r}")

    @property
    def label(self) -> str:
        """Report label: `name`, else "ar" | "<checkpoint dir>-<scheme>" | "<llm>-<scheme>"."""
        if self.name:
            return self.name
        if self.kind == "none":
            return BASELINE_LABEL
        if self.kind == "lookup":
            return "lookup-chain"
        base = Path(str(self.checkpoint)).name if self.kind == "head" else self.llm.name
        return f"{base}-{self.scheme}" + ("-lookup" if self.lookup else "")

    @property
    def report_scheme(self) -> str:
        return "ar" if self.kind == "none" else self.scheme


@dataclass
class EvalSettings:
    """The `eval` key. batch_size: requests decoded together (the engine's max batch; the
    prompts of a turn are queued at once and continuously batched). warmup: one short
    untimed generation per engine first, so lazy init (BLAS, kernels) is not timed.
    repeats: every run is timed this many times, the runs interleaved (ar, d1, d2, ar, d1,
    ...) so drift hits them alike; speeds are reported as median and best. Acceptance and
    outputs come from the first pass (greedy passes are identical)."""

    batch_size: int = 8
    chat: bool = True
    warmup: bool = True
    progress: bool = True
    repeats: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"eval.repeats must be an integer >= 1, got {self.repeats!r}")


@dataclass
class EvalConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    # Entries: preset names or DraftConfig-field mappings; list[DraftConfig] after validation.
    drafts: list[Any] = field(default_factory=list)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eval: EvalSettings = field(default_factory=EvalSettings)
    output_dir: str = "runs/eval"

    def __post_init__(self) -> None:
        self.drafts = [resolve_draft(d, f"drafts[{i}]") for i, d in enumerate(self.drafts)]
        labels = [d.label for d in self.draft_runs()]
        dup = sorted({x for x in labels if labels.count(x) > 1} | ({BASELINE_LABEL} & set(labels)))
        if dup:
            raise ValueError(f"drafts: run label(s) {dup} repeat or clash with the baseline "
                             f"{BASELINE_LABEL!r}; give each draft a distinct name=")

    def draft_runs(self) -> list[DraftConfig]:
        """The runs after the baseline: `drafts` if given, else `draft` unless none. A
        `kind: none` entry of `drafts` runs the autoregressive engine again, a control for
        drift between the runs of a pass (it needs a name other than the baseline's)."""
        if self.drafts:
            return list(self.drafts)
        return [] if self.draft.kind == "none" else [self.draft]


def load_draft_preset(name: str) -> Any:
    """conf/draft/<name>.yaml as a DictConfig over the DraftConfig schema."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "draft" / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (CONF_DIR / "draft").glob("*.yaml"))
        raise ValueError(f"draft preset {name!r} does not exist; use one of {options}")
    return OmegaConf.merge(OmegaConf.structured(DraftConfig), OmegaConf.load(path))


def resolve_draft(entry: Any, where: str) -> DraftConfig:
    """A `drafts` entry -> DraftConfig: a preset name, or a mapping over a preset (its
    `preset` key, else its `kind`, else "none"), or already a DraftConfig."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(entry, DraftConfig):
        return entry
    if isinstance(entry, str):
        preset, extra = entry, {}
    elif isinstance(entry, dict):
        extra = dict(entry)
        preset = extra.pop("preset", extra.get("kind", "none"))
    else:
        raise ValueError(f"{where}: expected a draft preset name or a mapping, got {entry!r}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(load_draft_preset(str(preset)), extra))
    except OmegaConfBaseException as exc:  # unknown key, missing checkpoint, wrong type
        raise ValueError(f"{where} ({entry!r}): {exc}".splitlines()[0]) from None
    except ValueError as exc:
        raise ValueError(f"{where} ({entry!r}): {exc}") from None
