"""Why a relay helps or not: two measurements over real greedy rounds (batch-1 reference round).

1. After a round that rejected a draft, the next round's slot 1 predicts the token after the
   bonus. Two guesses for it exist: the target's own prediction from its feature at the first
   rejected position (computed behind the wrong draft; this is what the relay carries), and
   the drafter's slot-1 draft. If the first is rarely right where the second already is, the
   rejected-suffix states carry little the drafter lacks.
2. How often the relay changes what the drafter proposes (rounds with any slot changed, and
   relayed slots changed).
"""

from __future__ import annotations

from dflow_rt.oracle import RoundTrace, generate


def relay_diagnostics(target, drafter, prompts: list[list[int]], max_new_tokens: int = 128,
                      stop_token_ids: tuple[int, ...] = ()) -> dict:
    traces = []
    for prompt in prompts:
        traces.append([])
        generate(target, drafter, prompt, max_new_tokens, stop_token_ids=stop_token_ids, trace=traces[-1])
    return summarize(traces)


def summarize(traces: list[list[RoundTrace]]) -> dict:
    """The two measurements over each prompt's consecutive rounds (see the module docstring)."""
    target_right = drafter_right = follow_ups = 0
    changed_rounds = relay_rounds = changed_slots = relay_slots = 0
    for trace in traces:
        for prev, cur in zip(trace, trace[1:], strict=False):
            width = len(prev.verified)  # block positions the target checked (all B by default)
            if prev.accepted >= width - 1:
                continue  # nothing was rejected: nothing to relay
            truth = cur.verified[0]  # the target's token after the bonus
            follow_ups += 1
            target_right += prev.verified[prev.accepted + 1] == truth
            drafter_right += cur.block[1] == truth
            if cur.drafts_without_relay is not None:
                n = width - 1 - prev.accepted  # slots 1..n carry relayed features
                diff = [x != y for x, y in zip(cur.block[1:], cur.drafts_without_relay, strict=True)]
                relay_rounds += 1
                changed_rounds += any(diff)
                relay_slots += n
                changed_slots += sum(diff[:n])
    out = {"rounds_after_rejection": follow_ups,
           "target_acc_at_rejected": target_right / max(follow_ups, 1),
           "drafter_slot1_acc": drafter_right / max(follow_ups, 1)}
    if relay_rounds:
        out |= {"relay_changes_round": changed_rounds / relay_rounds, "relay_changes_slot": changed_slots / relay_slots}
    return out
