"""Every exchange a rank takes part in has its twin on another rank: a real torchrun job on CPU
records each end it takes (exchange.DAPO_EXCHANGE_LOG), and every send is matched by a receive
of the same exchange and key on another rank, and every receive by a send."""
from collections import defaultdict
from pathlib import Path

import exchange
from tests.test_ranks import run_args, torchrun

EVERY_EXCHANGE = {"samples", "answer", "batch", "weights", "validation", "rank_state"}


def read_logs(folder: Path) -> dict[int, list[tuple[str, str, str]]]:
    """Each rank's ends, as (key, exchange, end), in the order it took them."""
    return {int(path.stem.split("_")[1]): [tuple(line.split()) for line in path.read_text().splitlines()]
            for path in folder.glob("rank_*.log")}


def unpaired(logs: dict[int, list[tuple[str, str, str]]]) -> list[str]:
    """The (key, exchange) whose sends or receives no other rank answers."""
    ends: dict[tuple[str, str], dict[str, set[int]]] = defaultdict(lambda: {"send": set(), "receive": set()})
    for rank, entries in logs.items():
        for key, name, end in entries:
            ends[key, name][end].add(rank)
    return [f"{name} {key}: sent by {sorted(by['send'])}, received by {sorted(by['receive'])}"
            for (key, name), by in sorted(ends.items())
            if not any(sender != receiver for sender in by["send"] for receiver in by["receive"])]


def test_unpaired_names_an_end_without_its_twin():
    logs = {0: [("1.1", "samples", "send"), ("1.1", "answer", "receive"), ("2", "weights", "receive")],
            1: [("1.1", "samples", "receive"), ("1.1", "answer", "send"), ("1", "weights", "send")]}
    assert unpaired(logs) == ["weights 1: sent by [1], received by []", "weights 2: sent by [], received by [0]"]
    assert unpaired({0: [("3", "batch", "send"), ("3", "batch", "receive")]}) == ["batch 3: sent by [0], received by [0]"]


def test_both_exchanges_have_the_leads_ends():
    lead_ends = {name for name in vars(exchange.LeadExchange) if not name.startswith("_")}
    assert lead_ends <= set(vars(exchange.Local)) and lead_ends <= set(vars(exchange.Torchrun))


def test_every_end_a_rank_takes_has_its_twin_on_another_rank(demo_assets, tmp_path, monkeypatch):
    logs = tmp_path / "exchanges"
    logs.mkdir()
    monkeypatch.setenv(exchange.LOG_ENV, str(logs))
    # One rollout rank, the lead and one other learner: every exchange of the table, each end once.
    proc = torchrun(3, run_args(demo_assets, tmp_path / "out", 2, "--learner_ranks", "2"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = read_logs(logs)
    assert sorted(ranks) == [0, 1, 2]
    assert {name for entries in ranks.values() for _, name, _ in entries} == EVERY_EXCHANGE
    assert unpaired(ranks) == []
