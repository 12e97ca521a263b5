"""The conformance table's fast subset (experiments/conformance.py): a model from a published
package (Hugging Face transformers' Flax GPT-2) trained through the public API with an int8 state,
and a plan a model cannot take refused in one line."""

from __future__ import annotations

import lowmem_jax as lm
from experiments import conformance


def test_transformers_flax_gpt2_trains_with_an_int8_state_updated_in_groups():
    cell = conformance.run_cell("gpt2", {"optimizer_state": "int8"}, "adam")
    assert cell["status"] == "ok", cell
    assert cell["losses"][-1] < cell["losses"][0] and cell["skipped_steps"] == 0
    (verdict,) = [v for v in cell["verdicts"] if v["technique"] == "optimizer_state"]
    assert verdict["took_effect"], verdict
    assert (
        "stored in int8" in verdict["evidence"] and "decoded and updated in" in verdict["evidence"]
    )


def test_a_plan_the_model_cannot_take_is_a_one_line_refusal():
    cell = conformance.run_cell("nnx_cnn", {"factorize": lm.FactorConfig()}, "adam")
    assert cell["status"] == "refused" and "factorize" in cell["error"], cell
    assert "\n" not in cell["error"]


def test_the_table_names_every_cell_and_the_rule():
    plain = {
        "status": "ok",
        "total_bytes": 100 * 2**20,
        "argument_bytes": 40 * 2**20,
        "verdicts": [],
    }
    int8 = {"status": "ok", "total_bytes": 80 * 2**20, "argument_bytes": 20 * 2**20, "verdicts": []}
    int8["state_rule"] = conformance._state_rule(int8, plain)
    assert int8["state_rule"]["holds"]  # 80 <= 100 - 0.9 * 20
    refused = {"status": "refused", "error": "ValueError: no"}
    result = {
        "command": conformance.COMMAND,
        "jax_version": "x",
        "steps": 4,
        "models": {
            "m": {
                "source": "s",
                "remat_block": "B",
                "rows": {"plain": {"adam": plain}, "state int8": {"adam": int8, "sgd": refused}},
            }
        },
    }
    text = conformance.markdown(result)
    assert "| state int8 | adam | ok; 80.0 MiB (rule holds: limit 82.0) |" in text
    assert "| state int8 | sgd | refused: ValueError: no |" in text
