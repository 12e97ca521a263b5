import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest

import lowmem_jax as lm
from lowmem_jax.analysis import memory
from lowmem_jax.analysis.flops import count_flops
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.compose.flags import plan_from_args
from lowmem_jax.ops import conv2d
from lowmem_jax.report.grid import model_grid, standard_grid
from lowmem_jax.report.run import run_report, write_report
from lowmem_jax.workloads import analyze_model

B, D, H, OUT = 16, 12, 32, 5
F32 = 4


def mlp_loss(params, model_state, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    y = h @ params["w2"]
    loss = 0.5 * jnp.mean((y - batch["y"]) ** 2)
    return loss, (model_state, {"loss": loss})


def cnn_loss(params, model_state, batch, rng):
    z = jax.lax.conv_general_dilated(
        batch["x"], params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    feats = jax.nn.relu(z).mean(axis=(1, 2))  # [B, C]
    y = feats @ params["w"]
    loss = 0.5 * jnp.mean((y - batch["y"]) ** 2)
    return loss, (model_state, {"loss": loss})


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_mlp_breakdown_matches_hand_count():
    params = {"w1": jnp.zeros((D, H)), "b1": jnp.zeros(H), "w2": jnp.zeros((H, OUT))}
    batch = {"x": jnp.zeros((B, D)), "y": jnp.zeros((B, OUT))}
    plan = lm.Plan()
    tx = optax.sgd(0.1, momentum=0.9)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    step = lm.make_train_step(mlp_loss, tx, plan)
    report = memory.analyze(
        step, _abstract(state), _abstract(batch), loss_fn=mlp_loss, plan=plan, tx=tx
    )
    a = report.analytic
    n_params = D * H + H + H * OUT
    assert report.param_count == n_params
    assert a["model_bytes"] == n_params * F32
    # gradients + one momentum ("trace") buffer, both parameter-sized float32
    assert a["optimizer_breakdown"] == {"gradients": n_params * F32, "slot:trace": n_params * F32}
    # saved for backprop: h = tanh(.) [B, H] for dW2, tanh's derivative 1 - h^2 [B, H] (JAX's
    # linearization keeps it rather than recomputing it from h) and 2 (y - t) [B, OUT]
    assert a["activation_bytes"] == (2 * B * H + B * OUT) * F32
    assert a["input_bytes"] == (B * D + B * OUT) * F32
    x = report.xla
    assert (
        x["total_bytes"]
        == x["argument_bytes"] + x["output_bytes"] + x["temp_bytes"] - x["alias_bytes"]
    )
    assert x["source"] == f"XLA:{jax.default_backend().upper()}"
    # 2 matmuls forward (x@w1, h@w2) + 3 backward (dW2, dh, dW1): 2*MACs each
    matmul_flops = 2 * (B * D * H + B * H * OUT) + 2 * (B * H * OUT * 2 + B * D * H)
    assert matmul_flops <= report.flops <= matmul_flops * 1.2


def test_cnn_breakdown_matches_hand_count():
    C, S = 8, 6
    params = {"k": jnp.zeros((3, 3, 3, C)), "w": jnp.zeros((C, OUT))}
    batch = {"x": jnp.zeros((B, S, S, 3)), "y": jnp.zeros((B, OUT))}
    tx = optax.adam(1e-3)
    plan = lm.Plan(microbatches=2)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    step = lm.make_train_step(cnn_loss, tx, plan)
    report = memory.analyze(
        step, _abstract(state), _abstract(batch), loss_fn=cnn_loss, plan=plan, tx=tx
    )
    a = report.analytic
    n_params = 3 * 3 * 3 * C + C * OUT
    mb = B // 2  # activations are per microbatch
    # relu keeps a bool mask [mb, S, S, C]; the mean keeps 1/(S*S)-scaled feats [mb, C] for the
    # dense layer's weight gradient; the loss keeps 2 (y - t) [mb, OUT]
    assert a["activation_bytes"] == mb * S * S * C * 1 + (mb * C + mb * OUT) * F32
    breakdown = a["optimizer_breakdown"]
    assert breakdown["gradients"] == n_params * F32
    assert breakdown["gradient_accumulator"] == n_params * F32
    assert breakdown["slot:mu"] == breakdown["slot:nu"] == n_params * F32


@pytest.mark.slow
def test_half_precision_halves_model_bytes():
    full = analyze_model("wrn-10-1", 8, lm.Plan(), image_size=8)
    half = analyze_model("wrn-10-1", 8, lm.Plan(precision="bf16"), image_size=8)
    assert half.analytic["model_bytes"] * 2 == full.analytic["model_bytes"]
    assert half.analytic["model_bytes_by_dtype"] == {"bfloat16": half.analytic["model_bytes"]}
    assert half.analytic["activation_bytes"] < full.analytic["activation_bytes"]


@pytest.mark.slow
def test_xla_temp_falls_as_microbatches_grow():
    temps = [
        analyze_model("wrn-16-1", 64, lm.Plan(microbatches=k), image_size=16).xla["temp_bytes"]
        for k in (1, 2, 4, 8)
    ]
    assert temps == sorted(temps, reverse=True) and temps[0] > 3 * temps[-1], temps


@pytest.mark.slow
def test_xla_temp_falls_as_remat_saves_less():
    reports = {
        p: analyze_model("wrn-28-1", 32, lm.Plan(remat=p), image_size=16)
        for p in ("none", "dots", "full")
    }
    temps = [reports[p].xla["temp_bytes"] for p in ("none", "dots", "full")]
    acts = [reports[p].analytic["activation_bytes"] for p in ("none", "dots", "full")]
    assert temps[0] > temps[1] > temps[2], temps
    assert acts[0] > acts[1] > acts[2], acts
    # remat costs recomputation: more FLOPs, counted through the loop bodies
    assert reports["full"].flops > reports["none"].flops


def test_the_analysis_compile_gives_the_default_builds_bytes():
    """``analyze`` compiles at LLVM optimisation level 0 on XLA:CPU (never run): the buffers are
    assigned before code generation, so every figure equals the default build's (level 3,
    asked for explicitly: the suite's XLA_FLAGS already say 0), on a step with microbatch and
    remat loops, half precision and the loss scale's conditional skip."""
    from lowmem_jax.workloads import build, workload

    assert memory.analysis_compiler_options("cpu") == {"xla_backend_optimization_level": 0}
    assert memory.analysis_compiler_options("gpu") == {}
    plan = lm.Plan(precision="mixed_fp16", microbatches=2, remat="full")
    setup = build(workload("wrn-10-1", 8, image_size=8), plan)
    lowered = setup.step.lower(setup.abstract_state(), setup.abstract_batch())
    analysis = lowered.compile(memory.analysis_compiler_options())
    default = lowered.compile({"xla_backend_optimization_level": 3})
    assert memory.xla_memory(analysis) == memory.xla_memory(default)
    assert setup.analyze().xla == memory.xla_memory(default)
    assert analysis.as_text() == default.as_text()  # the same optimised HLO and schedule


def test_analyze_cli_prints_exactly_one_json_object(capsys):
    assert (
        cli.main(
            [
                "analyze",
                "--model",
                "wrn-10-1",
                "--batch-size",
                "8",
                "--microbatches",
                "2",
                "--remat",
                "full",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    for key in (
        "model",
        "batch_size",
        "config",
        "param_count",
        "backend",
        "xla",
        "analytic",
        "flops",
    ):
        assert key in result
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes"):
        assert isinstance(result["xla"][key], int)
    for key in ("model_bytes", "optimizer_bytes", "activation_bytes", "input_bytes", "total_bytes"):
        assert isinstance(result["analytic"][key], int)
    assert result["config"]["microbatches"] == 2 and result["config"]["remat"] == "full"


@pytest.mark.parametrize(
    "argv",
    [
        ["--remat", "bogus"],
        ["--model", "vgg"],
        ["--microbatches", "3"],
        ["--sparse-algorithm", "magic"],
    ],
)
def test_analyze_cli_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "--batch-size", "8", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err


@pytest.mark.slow
def test_report_writes_tables_and_plots(tmp_path):
    # A static mask: compressed storage without a rewiring to compile (a third of the time).
    wanted = ("plain", "baseline", "microbatch 4", "fp16 + mb 2 + remat full + static sparse 70%")
    grid = [g for g in standard_grid(8) if g[0] in wanted]
    assert [g[0] for g in grid] == list(wanted)
    assert grid[0][2] is None  # plain: no plan
    assert all(len(row) == 3 and isinstance(row[2], lm.Plan) for row in grid[1:])
    plans = {name: plan for name, _, plan in grid}
    assert plans[wanted[-1]].sparsity.compressed and plans["baseline"].sparsity is None
    lines = []
    result = run_report("wrn-10-1", 8, grid=grid, progress=lines.append, jobs=2)  # threads
    assert [line.split("]")[0] for line in lines] == [f"[{i:2d}/{len(grid)}" for i in
                                                      range(1, len(grid) + 1)]  # fmt: skip
    assert [r["name"] for r in result["configs"]] == list(wanted)  # grid order, whatever jobs
    paths = write_report(result, str(tmp_path), command="test")
    assert {p.split("/")[-1] for p in paths} == {
        "report.json",
        "report.md",
        "breakdown.png",
        "tradeoff.png",
    }
    rows = {r["name"]: r for r in result["configs"]}
    assert rows["baseline"]["reduction_xla"] == 1.0 and rows["plain"]["reduction_xla_vs_plain"] == 1
    assert rows["microbatch 4"]["reduction_xla"] > 1.0
    for r in rows.values():  # the same total, two denominators
        plain, base = rows["plain"]["xla"]["total_bytes"], rows["baseline"]["xla"]["total_bytes"]
        assert r["reduction_xla_vs_plain"] == pytest.approx(r["reduction_xla"] * plain / base)
    sparse = rows[wanted[-1]]
    assert sparse["config"]["sparsity"]["storage"] == "compressed"
    # 30% of the weights in float16 with int32 indices: under half the float32 dense bytes.
    assert sparse["analytic"]["model_bytes"] < 0.5 * rows["baseline"]["analytic"]["model_bytes"]
    best = result["best"]
    assert best["reduction_xla"] == max(r["reduction_xla"] for r in rows.values())
    assert best["reduction_xla_vs_plain"] == rows[best["name"]]["reduction_xla_vs_plain"]
    # At batch 8 only the unsplit fp32 steps lie inside the envelope.
    inside = result["best_in_envelope"]
    assert inside["name"] in ("plain", "baseline") and inside["envelope"]["max_sparsity"] == 0.7
    # The recorded flags reproduce the best row's figures.
    assert best["argv"] == rows[best["name"]]["argv"]
    assert best["argv"][:4] == ["--model", "wrn-10-1", "--batch-size", "8"]
    args = cli.build_parser().parse_args(["analyze", *best["argv"], "--json"])
    again = analyze_model("wrn-10-1", 8, plan_from_args(args, lm.Plan()))
    assert again.xla == rows[best["name"]]["xla"]
    text = (tmp_path / "report.md").read_text()
    assert "| microbatch 4 |" in text and f"`lowmem analyze {' '.join(best['argv'])}`" in text


def test_the_time_left_weighs_each_row_by_its_plan_s_compile_cost(monkeypatch):
    """Rows whose steps compile longer (dynamic sparsity's rewiring) count for more in the
    estimate: with analyses that take exactly their plan's cost, the estimate is exact."""
    import threading
    import types

    from lowmem_jax.report import run as report_lib
    from lowmem_jax.techniques.sparsity import report_sparsity

    # One analysis per line printed, in grid order: the pool's threads may start any row, so
    # row i waits for its turn (a semaphore let a later row take the first turn: a deadlock).
    now, started, printed, turn = [0.0], [0], [0], threading.Condition()

    def analyze(model, batch_size, plan, seq_len, compiling):
        with turn:
            turn.wait_for(lambda: grid[started[0]][2] is plan and printed[0] == started[0])
            started[0] += 1
        now[0] += 1.0 if plan is None else plan.compile_cost()
        config = {"plain": True} if plan is None else plan.to_dict()
        figures = {"total_bytes": 100, "source": "test"}
        return types.SimpleNamespace(to_dict=lambda: {
            "xla": figures, "analytic": figures, "flops": 1.0,
            "config": {"batch_size": batch_size, **config},
        })  # fmt: skip

    monkeypatch.setattr(report_lib, "analyze_model", analyze)
    monkeypatch.setattr(report_lib, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    dsr = lm.Plan(sparsity=report_sparsity(0.7))
    static = lm.Plan(sparsity=dataclasses.replace(dsr.sparsity, algorithm="static"))
    assert dsr.compile_cost() == 3.5 and static.compile_cost() == lm.Plan().compile_cost() == 1
    grid = [("plain", "plain", None), ("baseline", "baseline", lm.Plan()),
            ("dsr", "sparsity", dsr), ("static", "sparsity", static),
            ("dsr 2", "sparsity", dsr)]  # fmt: skip
    lines: list[str] = []

    def progress(line):
        lines.append(line)
        with turn:
            printed[0] += 1
            turn.notify_all()

    run_report("wrn-10-1", 8, grid=grid, progress=progress)
    left = [float(line.split("~")[1].split("s left")[0]) for line in lines]
    assert left == [9, 8, 4, 4, 0]  # 1 + 3.5 + 1 + 3.5, then 3.5 + 1 + 3.5, ...: rounded


def test_the_envelope_is_the_technical_reports_safe_region():
    from lowmem_jax.report.run import in_envelope

    def config(**kw):
        plan = lm.Plan(**kw)
        return {"batch_size": 128, **plan.to_dict()}

    assert in_envelope({"plain": True, "batch_size": 128})
    assert in_envelope(config()) and in_envelope(config(precision="mixed_fp16", remat="full"))
    assert in_envelope(config(microbatches=16))  # microbatches of 8 examples
    assert not in_envelope(config(microbatches=32))  # of 4
    assert not in_envelope(config(precision="fp16"))  # fp16 master weights
    dsr = lm.sparsity.SparseConfig(algorithm="dsr", density=0.3, compressed=True)
    assert in_envelope(config(sparsity=dsr))  # 70%
    assert not in_envelope(config(sparsity=dataclasses.replace(dsr, density=0.1)))  # 90%
    names = {name for name, _, _ in standard_grid(128)}
    assert {
        "mixed_fp16 + mb 8 + remat full",
        "mixed_fp16 + mb 8 + remat full + sparse 70%",
        "mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input",
        "fp16 + mb 2 + remat full + sparse 90% + uint8 input",
        "uint8 input",
    } <= names
    grid = {name: plan for name, _, plan in model_grid("wrn-28-2", 128)}
    uint8 = grid["fp16 + mb 2 + remat full + sparse 90% + uint8 input"]
    assert uint8 == dataclasses.replace(
        grid["fp16 + mb 2 + remat full + sparse 90%"], input_dtype="uint8"
    )
    assert in_envelope({"batch_size": 128, **grid["uint8 input"].to_dict()})
    tokens = [name for name, _, _ in model_grid("dynamicconv-iwslt", 100)]  # no images
    assert not [name for name in tokens if "uint8" in name] and "baseline" in tokens


def test_count_flops_counts_matmuls_and_loop_trips():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 3))
    flops, _ = count_flops(lambda x, y: x @ y, a, b)
    assert flops == 2 * 4 * 8 * 3

    def scanned(x, y):
        return jax.lax.scan(lambda c, _: (c, c @ y), x, None, length=5)[1]

    flops, _ = count_flops(scanned, a, b)
    assert flops == 5 * 2 * 4 * 8 * 3  # the loop body times its trip count


def test_count_flops_skips_the_zeros_of_a_dilated_input():
    """The input gradient of a stride-2 convolution is a convolution over the output gradient
    dilated by 2: it multiplies as many real samples as the forward pass, not 4x as many;
    the loop-friendly convolution's phase decomposition computes the same."""
    x, w = jnp.ones((8, 16, 16, 16)), jnp.ones((3, 3, 16, 32))
    forward, _ = count_flops(lambda x: conv2d(x, w, (2, 2), "SAME", impl="xla"), x)
    assert forward == 2 * (8 * 8 * 8 * 32) * (3 * 3 * 16)
    grad = jax.grad(lambda x: conv2d(x, w, (2, 2), "SAME", impl="xla").sum())
    flops, _ = count_flops(grad, x)
    # The transpose alone: the forward output is dead code for the gradient of a sum.
    assert flops == pytest.approx(forward, abs=8)
    friendly = jax.grad(lambda x: conv2d(x, w, (2, 2), "SAME", impl="loop_friendly").sum())
    # its backward computes the kernel's gradient too (a custom_vjp), then drops it as dead code
    assert count_flops(friendly, x)[0] == pytest.approx(forward, abs=8)


def test_typed_prng_keys_saved_for_backward_are_counted():
    @jax.checkpoint
    def dropout_matmul(w, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, x, 0.0) @ w

    def loss_fn(params, model_state, batch, rng):
        key = jax.random.fold_in(rng, 1)  # a derived typed key: the remat block saves it
        loss = jnp.sum(dropout_matmul(params["w"], batch["x"], key) ** 2)
        return loss, (model_state, {})

    params = {"w": jnp.ones((4, 4))}
    out = memory.saved_activation_bytes(
        loss_fn, params, {}, {"x": jnp.ones((2, 4))}, jax.random.key(0)
    )
    key_bytes = jax.random.key_data(jax.random.key(0)).nbytes
    assert out["bytes"] >= key_bytes


def test_analyze_cli_dynamicconv(capsys):
    """The translation model through the CLI (the small preset: the IWSLT one compiles for a
    minute; its 38,685,184 parameters are counted by hand in test_dynamic_conv.py)."""
    argv = ["analyze", "--model", "dynamicconv-small", "--batch-size", "4", "--seq-len", "8"]
    assert cli.main([*argv, "--precision", "mixed_bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    tokens = jax.ShapeDtypeStruct((1, 3), jnp.int32)  # shapes only: no op-by-op init
    init = lm.workload("dynamicconv-small").model.init
    params = jax.eval_shape(init, jax.random.key(0), tokens, tokens)["params"]
    count = sum(x.size for x in jax.tree.leaves(params))
    assert result["param_count"] == count and result["batch_size"] == 4
    a = result["analytic"]
    assert a["model_bytes"] == count * 4
    # adamw: gradients + mu + nu, all parameter-sized float32 (+ step counts)
    assert a["optimizer_bytes"] >= 3 * a["model_bytes"]
    assert a["input_bytes"] == 3 * 4 * 8 * 4


@pytest.mark.slow
def test_analyze_cli_sparsity_shrinks_stored_bytes(capsys):
    base = ["analyze", "--model", "wrn-16-1", "--batch-size", "8", "--json"]
    assert cli.main(base) == 0
    dense = json.loads(capsys.readouterr().out)
    # A static mask: the stored bytes of any algorithm, without a rewiring to compile.
    assert cli.main([*base, "--sparsity", "0.9", "--sparse-algorithm", "static"]) == 0
    sparse = json.loads(capsys.readouterr().out)
    assert sparse["config"]["sparsity"] == {
        "algorithm": "static", "sparsity": 0.9, "distribution": "uniform", "storage": "compressed"
    }  # fmt: skip
    assert sparse["param_count"] == dense["param_count"]  # the model is the same, dense
    assert sparse["analytic"]["model_bytes"] < 0.25 * dense["analytic"]["model_bytes"]
    assert sparse["xla"]["argument_bytes"] < 0.5 * dense["xla"]["argument_bytes"]


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_analyze_cli_rejects_bad_sparsity(value, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "--batch-size", "8", "--sparsity", value])
    assert exc.value.code == 2 and "--sparsity" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model,batch,folder",
    [("wrn-28-2", 128, "memory_report"), ("dynamicconv-iwslt", 100, "memory_report_dynamicconv")],
)
def test_the_quick_grid_holds_each_technique_and_the_committed_headline_rows(model, batch, folder):
    """lowmem report's default grid is a quarter of the full one and still answers its
    question: the plain step, the baseline, each technique alone, and the rows the committed
    full reports chose as best and best inside the envelope."""
    quick = [name for name, _, _ in model_grid(model, batch, "quick")]
    full = [name for name, _, _ in model_grid(model, batch)]
    assert quick == [n for n in full if n in quick] and len(quick) <= len(full) // 3
    results = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results"
    committed = json.loads((results / folder / "report.json").read_text())
    assert committed["best"]["name"] in quick and committed["best_in_envelope"]["name"] in quick
    groups = {group for name, group, _ in model_grid(model, batch, "quick")}
    assert {"plain", "baseline", "precision", "microbatching", "remat", "sparsity",
            "optimizer state", "factorization", "combined"} <= groups  # fmt: skip
    with pytest.raises(ValueError, match="Unknown grid='tiny'; allowed values"):
        model_grid(model, batch, "tiny")
