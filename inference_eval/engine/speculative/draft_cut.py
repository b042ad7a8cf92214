"""Where a round stops drafting: the rules of draft.confidence_cut, read off the draft side.

Each draft step s = 1, 2, ... of a round gives every live request a confidence c_s (its law's
top probability, or the drafter's own confidence head). The rule decides, per request, whether
d_s is kept; the first draft it refuses ends that request's drafting for the round (the drafts
before it are verified). Every rule reads the drafts' confidences only, never the target, so
verification stays lossless whatever it decides.

  draft   keep d_s while c_s >= min_confidence (EAGLE-2's cut, for a line)
  prefix  keep d_s while c_1 ... c_s >= min_confidence (the chance that all of them are
          accepted: SpecDec++'s stopping rule)
  rate    keep d_s while it raises the round's expected tokens per unit of time (DSpark's
          scheduler): with a_j = the calibrated acceptance of a draft of confidence c_j,
          P_s = a_1 ... a_s, E(s) = 1 + P_1 + ... + P_s (tokens a round of s drafts emits on
          average, the bonus included) and cost(s) = draft.round_costs[s] (a round that
          verifies s drafts, in AR steps), d_s is kept iff E(s) / cost(s) > E(s-1) / cost(s-1).
          On a device where verifying five rows costs what one does, every draft with any
          chance is kept; on a CPU, where each row costs ~0.1-0.15 AR steps, only the likely
          ones.

The rate rule's calibration (`Calibration`) learns, while decoding, how often a draft of each
confidence is accepted: 10 confidence bins, each starting at its drafts' own confidence with
the weight of `PRIOR` observations, then counting the drafts the target judged (d_s is judged
when d_1 .. d_{s-1} were accepted). A head whose confidences run high or low is corrected
after a few rounds; lookup's drafts (confidence 1) are judged in the top bin. A bin whose
drafts the rule refuses would never be judged again, so every `EXPLORE`-th round keeps each
request's first draft whatever the rule says (the rule goes on from there): a head whose
confidences run low (a flat law that is right anyway) is found out, at the price of one
verified row every EXPLORE rounds.
"""
from __future__ import annotations

CONFIDENCE_CUTS = ("draft", "prefix", "rate")
BINS = 10
PRIOR = 4.0  # pseudo-observations per bin at the drafts' own confidence
EXPLORE = 8  # every EXPLORE-th round (of an engine) keeps each request's first draft


def round_costs(verify: list[float], base: float, kept: float = 0.0, step: float = 0.0,
                max_steps: int | None = None) -> list[float]:
    """draft.round_costs from a machine's measured parts, all in one unit (ms or AR steps):
    verify [K + 1], the target's pass over s + 1 rows (verify[0]: one row, an AR step); base,
    the draft work every round pays (a refill, a context write and a pass that gives d_1);
    kept, work paid once d_1 is kept (P-EAGLE's mask pass); step, one sequential draft step,
    run after each kept draft but the last allowed (max_steps, default K - 1) to draft its
    successor before the rule judges it -> [c_0..c_K], c_s = base + kept [s > 0] +
    min(s, max_steps) step + verify[s], over verify[0] (in AR steps)."""
    k = len(verify) - 1
    cap = k - 1 if max_steps is None else max_steps
    return [(base + (kept if s else 0.0) + min(s, cap) * step + verify[s]) / verify[0]
            for s in range(k + 1)]


class Calibration:
    """Confidence -> the acceptance rate of drafts that confident, learnt from the rounds."""

    def __init__(self) -> None:
        self.judged = [0.0] * BINS  # drafts the target judged, per bin
        self.accepted = [0.0] * BINS

    @staticmethod
    def bin(c: float) -> int:
        return min(max(int(c * BINS), 0), BINS - 1)

    def rate(self, c: float) -> float:
        b = self.bin(c)
        return (self.accepted[b] + PRIOR * c) / (self.judged[b] + PRIOR)

    def observe(self, confs: list[float], accepted: int) -> None:
        """One request's round: confs [k] of its verified drafts d_1..d_k; `accepted` of them
        were accepted, so d_1 .. d_{accepted + 1} were judged (the rest never were)."""
        for s, c in enumerate(confs[:accepted + 1]):
            b = self.bin(c)
            self.judged[b] += 1
            self.accepted[b] += s < accepted


class _RequestRound:
    """One request's running state in a round."""

    __slots__ = ("product", "expected", "confs", "explore")

    def __init__(self, explore: bool = False) -> None:
        self.explore = explore  # keep the first draft whatever the rule says
        self.product = 1.0  # P_s (rate) or the raw product of confidences (prefix)
        self.expected = 1.0  # E(s): the bonus token counts
        self.confs: list[float] = []  # the kept drafts' confidences


class DraftCut:
    """The rule of one engine. Per round: `begin(b)` -> a state for b requests; `keep(state,
    live, conf)` per draft step; `end(state, accepted)` once the target has judged."""

    def __init__(self, rule: str, min_confidence: float = 0.0,
                 round_costs: list[float] | None = None, max_drafts: int = 1) -> None:
        if rule not in CONFIDENCE_CUTS:
            raise ValueError(f"draft.confidence_cut={rule!r}: use one of {CONFIDENCE_CUTS}")
        if rule == "prefix" and min_confidence <= 0:
            raise ValueError("draft.confidence_cut=prefix compares with draft.min_confidence: "
                             "set it in (0, 1)")
        if rule != "rate" and round_costs is not None:
            raise ValueError("draft.round_costs is read by draft.confidence_cut=rate only")
        if rule == "rate" and min_confidence > 0:
            raise ValueError("draft.confidence_cut=rate reads draft.round_costs, not "
                             "draft.min_confidence: leave it at 0")
        if rule == "rate":
            if not round_costs or len(round_costs) < max_drafts + 1:
                raise ValueError(
                    f"draft.confidence_cut=rate needs draft.round_costs: {max_drafts + 1} costs, "
                    "a round verifying 0..K drafts in AR steps (scripts/bench_block_pass.py "
                    "prints them for a machine, scripts/bench_spec.py --steps-only a chain's)")
            if any(not c > 0 for c in round_costs):
                raise ValueError(f"draft.round_costs={list(round_costs)}: costs must be > 0")
        self.rule = rule
        self.min_confidence = min_confidence
        self.round_costs = [float(c) for c in round_costs] if round_costs else None
        self.calibration = Calibration()
        self.rounds = 0

    @property
    def active(self) -> bool:
        """Whether the rule reads confidences at all (the draft rule at 0 keeps everything,
        and then a round reads nothing back to the host)."""
        return self.rule == "rate" or self.min_confidence > 0

    def begin(self, b: int) -> list[_RequestRound]:
        explore = self.rule == "rate" and self.rounds % EXPLORE == 0
        self.rounds += 1
        return [_RequestRound(explore) for _ in range(b)]

    def keep(self, state: list[_RequestRound], live: list[int], conf: list[float]) -> list[bool]:
        """Draft step s = len(confs kept so far) + 1 of each live request (request live[j]
        has confidence conf[j]) -> whether its d_s is kept."""
        out = []
        for j, i in enumerate(live):
            r, c = state[i], conf[j]
            if self.rule == "draft":
                ok = c >= self.min_confidence
            elif self.rule == "prefix":
                ok = r.product * c >= self.min_confidence
                r.product *= c if ok else 1.0
            else:
                ok = self._pays(r, c)
            if ok:
                r.confs.append(c)
            out.append(ok)
        return out

    def _pays(self, r: _RequestRound, c: float) -> bool:
        s, costs = len(r.confs) + 1, self.round_costs
        if s >= len(costs):
            return False
        p = r.product * self.calibration.rate(c)
        explored = s == 1 and r.explore
        if not explored and (r.expected + p) * costs[s - 1] <= r.expected * costs[s]:
            return False
        r.product, r.expected = p, r.expected + p
        return True

    def end(self, state: list[_RequestRound], accepted: list[int]) -> None:
        """The round's accepted draft counts, per request of `begin`: the rate rule learns."""
        if self.rule != "rate":
            return
        for r, a in zip(state, accepted):
            if r.confs:
                self.calibration.observe(r.confs, a)
