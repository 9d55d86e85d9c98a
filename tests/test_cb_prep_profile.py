"""``benchmarks/cb_prep_profile.py`` on the CPU: a short serve through the step timers (parts
recorded on the pure-decode steps, the rests computed consistently, transformers' and
breakgraph's methods restored afterwards) and the report section made from its JSON."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")


from benchmarks import cb_prep_profile, report_cb_host  # noqa: E402
from tests.helpers import needs_continuous_batching  # noqa: E402

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("one_cpu_thread")]
needs_cb = needs_continuous_batching()


@needs_cb
def test_a_method_the_profile_cannot_find_is_an_error(monkeypatch):
    """A part whose method transformers renamed raises instead of dropping out as zero."""
    from breakgraph.patches import PatchSet

    parts = (*cb_prep_profile.PARTS, ("gone", "transformers.generation.continuous_batching.cache",
                                      "no_such_method"))  # fmt: skip
    monkeypatch.setattr(cb_prep_profile, "PARTS", parts)
    with pytest.raises(RuntimeError, match="no_such_method"), PatchSet() as patches:
        cb_prep_profile.StepTimers().install(patches)


def _methods() -> dict:
    import importlib

    found = {}
    for _, module_name, method in cb_prep_profile.PARTS:
        module = importlib.import_module(module_name)
        for owner in vars(module).values():
            if isinstance(owner, type) and method in vars(owner):
                found[(owner, method)] = vars(owner)[method]
    return found


@needs_cb
def test_step_timers_split_decode_steps_into_parts_and_leave_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(cb_prep_profile, "MIN_REQUESTS", 2)
    before = _methods()
    out = tmp_path / "prep.json"
    assert cb_prep_profile.main(["--out", str(out), "--requests", "3", "--new-tokens", "4",
                                 "--rounds", "1", "--plain-passes", "1"]) == 0  # fmt: skip
    assert _methods() == before  # every wrapped method is the original again
    data = json.loads(out.read_text())
    parts = data["decode_parts_ms"]
    assert data["decode_steps"] >= 1 and data["decode_requests_median"] >= 2
    timed = ("index lists", "list conversion", "scheduler", "other batch tensors", "update")
    assert all(parts[name] > 0 for name in timed), parts  # every wrapper saw its calls
    # means over the same steps, each step's parts inside its whole: the parts add up
    assert parts["prepare"] >= parts["index lists"] + parts["list conversion"] + parts["scheduler"]
    assert data["settings"]["min_requests"] == 2
    assert data["meta"]["gpu"].startswith("none (")
    text = report_cb_host.prep_parts_section([data])
    assert f"| index lists | {parts['index lists']:.2f} (" in text
    assert "### A pure-decode step's preparation, part by part" in text


@needs_cb
def test_block_table_mode_times_the_table_instead_of_the_lists(monkeypatch, tmp_path):
    """``--block-table``: the steps go through breakgraph's (emulated) graphs, pure-decode steps
    come with transformers' block table, and the profile times its filling where the index
    lists were; the section puts both modes side by side."""
    monkeypatch.setattr(cb_prep_profile, "MIN_REQUESTS", 2)
    runs = []
    for mode in ([], ["--block-table"]):
        out = tmp_path / f"prep{len(mode)}.json"
        assert cb_prep_profile.main(["--out", str(out), "--requests", "3", "--new-tokens", "4",
                                     "--rounds", "1", "--plain-passes", "1", *mode]) == 0
        runs.append(json.loads(out.read_text()))
    lists, tables = (r["decode_parts_ms"] for r in runs)
    assert lists["block table"] == 0 and lists["index lists"] > 0, lists
    assert tables["block table"] > 0 and tables["index lists"] == 0, tables
    assert runs[1]["settings"]["block_table"] is True
    assert runs[1]["settings"]["table_fill"] == "numpy"  # breakgraph's fill (contract item 16)
    text = report_cb_host.prep_parts_section(runs)
    version = transformers.__version__
    assert f"{version}, lists ms (share)" in text
    assert f"{version}, block table, numpy fill ms" in text
    assert f"| block table | 0.00 (0%) | {tables['block table']:.2f} (" in text


def test_the_fill_views_probe_times_both_trees_on_both_layouts(tmp_path):
    """``benchmarks/fill_views_probe.py`` loads the earlier tree's fill from git (here this
    commit's), checks that both trees write the same ids and times them in turn; the report
    sentence is made from its JSON."""
    from benchmarks import fill_views_probe

    out = tmp_path / "probe.json"
    fill_views_probe.main(["--before", "HEAD", "--out", str(out), "--requests", "6",
                           "--rounds", "2", "--repeats", "1"])  # fmt: skip
    data = json.loads(out.read_text())
    assert set(data["layouts"]) == {"5.17 (managers)", "5.18+ (allocators)"}
    for row in data["layouts"].values():
        assert len(row["rounds_us"]["before"]) == len(row["rounds_us"]["after"]) == 2
        assert row["before_us"] > 0 and row["after_us"] > 0
    text = report_cb_host._fill_views([data])
    assert "fill_views_probe.py" in text and "µs saved per request" in text
    assert "not measured" in report_cb_host._fill_views([])


@needs_cb
def test_sliding_model_with_transformers_rows_writes_every_steps_medians(monkeypatch, tmp_path):
    """``--sliding --tx-rows``: a model of Gemma 3's layer kinds (6 layers here), transformers'
    own index lists while enabled (breakgraph's numpy rows not installed, then nothing left);
    the JSON holds every step's medians even without pure-decode steps of ``MIN_REQUESTS``."""
    from breakgraph.integrations.transformers import compat

    from benchmarks import families

    monkeypatch.setattr(families, "GEMMA3_1B", dict(families.GEMMA3_1B, num_hidden_layers=6))
    installed = []
    method = compat.index_list_builder().__dict__["extend_read_and_write_indices"]
    timed = cb_prep_profile.serve

    def serve(*args, **kwargs):
        current = compat.index_list_builder().__dict__["extend_read_and_write_indices"]
        installed.append(getattr(current, "__wrapped__", current) is not current)
        return timed(*args, **kwargs)

    monkeypatch.setattr(cb_prep_profile, "serve", serve)
    out = tmp_path / "sliding.json"
    cb_prep_profile.main(["--out", str(out), "--requests", "3", "--new-tokens", "4", "--rounds",
                          "1", "--plain-passes", "1", "--sliding", "--tx-rows"])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["settings"]["rows"] == "transformers" and "Gemma" in data["settings"]["model"]
    assert data["steps"] >= 4 and data["steps_median_ms"]["prepare"] > 0
    assert installed == [False, False]  # transformers' own method served every pass
    assert compat.index_list_builder().__dict__["extend_read_and_write_indices"] is method
