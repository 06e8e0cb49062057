"""peft's in-place merges (merge_and_unload, merge_adapter, unmerge_adapter, unload) on a
model trained with zerodp: refused on every rank before any weight changes, pointing to
zerodp's merged export (docs/finetuning.md, "Merging"). Cases: peft_merge_cases.py."""
import pytest

pytest.importorskip("peft")

import peft_merge_cases as cases  # noqa: E402


@pytest.mark.parametrize("stage", [3, 1])
def test_in_place_merges_are_refused_before_any_weight_changes(pool, stage):
    results = pool.run(2, cases.in_place_merges, stage, timeout_s=120)
    for rank, r in enumerate(results):
        for name, entry in r.items():
            # Unchanged, bit for bit: nothing was merged halfway.
            assert entry["logits_equal"] and entry["state_equal"], (stage, rank, name, entry)
            error = entry["error"]
            assert error is not None and error.startswith("RuntimeError"), (stage, rank, name, entry)
            # The error says what to call instead.
            assert "zerodp.integrations.peft.save_merged" in error and "merged_state_dict" in error, error
            assert name.split(".")[-1] in error, error
        assert list(r) == list(cases.CALLS), (rank, r)  # every call was tried: none changed the model
