"""The tiny training runs the tests make: RotatedDigits with a small CNN, seconds each, a
tiny image folder, and a few jitted train steps of an objective on a tiny network
(:func:`train_steps`, which the method tests compare with their float64 re-statements)."""

import os

import numpy as np
from PIL import Image

from sagm_jax.config import base_config, mnist_config


def digits_config(**overrides):
    """A RotatedDigits run on one device: the tests of sharding ask for ``num_devices=0``
    (all eight fake devices), which compiles and steps slower on the CPU."""
    config = mnist_config("RotatedDigits")
    config.update(
        dict(
            batch_per_env=8,
            steps=5,
            eval_every=2,
            log_every=1,
            eval_batch_size=64,
            cnn_widths=(16, 32, 32, 32),
            num_devices=1,
        )
    )
    config.update(overrides)
    return config


def write_image_tree(root, domains=("art", "photo", "sketch"), classes=("cat", "dog"), n=4):
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            os.makedirs(root / d / c)
            for k in range(n):
                size = (int(rng.integers(20, 50)), int(rng.integers(20, 50)))
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / d / c / f"{k}.jpg")


def image_folder(root, domains=("a", "b"), classes=("x", "y")) -> str:
    """A tiny DATA_DIR/<domain>/<class>/<image> folder: two 8x8 PNGs per class."""
    for domain in domains:
        for name in classes:
            os.makedirs(root / domain / name)
            for i in range(2):
                Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / domain / name / f"{i}.png")
    return str(root)


def tiny_folder_config(tmp_path, **overrides):
    """An ImageFolder run of ``tmp_path/data`` (write_image_tree) with the MNIST CNN on
    16x16 inputs, ERM, small batches."""
    config = base_config()
    config.update(
        dict(
            dataset="ImageFolder",
            data_dir=str(tmp_path / "data"),
            arch="mnist_cnn",
            pretrained_weights="none",
            image_size=16,
            batch_per_env=4,
            eval_batch_size=8,
            algorithm="erm",
        )
    )
    config.update(overrides)
    return config


def assert_the_evaluation_reproduces_the_record(workdir, which):
    """``load_run(workdir, which)`` on a RotatedDigits run (test environment 0): its
    model's evaluation over the evaluator's batches reproduces the record's accuracies,
    and on the unpadded batches its argmax, counted here, is the evaluation's count
    (the padded last batch's count is the evaluator's own). Returns ``(model,
    variables)``."""
    import jax
    import jax.numpy as jnp

    from sagm_jax import data as data_lib
    from sagm_jax.methods.networks import MethodModel
    from sagm_jax.training import evaluation, loading
    from sagm_jax.training.rundir import read_config

    model, variables, record = loading.load_run(str(workdir), which)
    # On one device: on the eight the variables are restored to (replicated), each device
    # ran every batch whole.
    variables = jax.device_get(variables)
    config = read_config(str(workdir))
    dataset = data_lib.load("RotatedDigits", None, trial_seed=0, data_seed=0)
    evaluate = evaluation.make_eval_step(model, jnp.float32, config["seed"],
                                         config["image_size"])
    extra = (lambda key: {"key": key}) if isinstance(model, MethodModel) else (lambda key: {})
    apply = jax.jit(lambda v, x, key: model.apply(v, x, train=False, **extra(key)))
    unpadded = 0
    for env, part in ((0, "in"), (0, "out"), (1, "out")):
        correct = counted = 0
        batches = dataset.eval_iterator(env, part, batch_size=record["eval_batch_size"],
                                        batch_multiple=jax.device_count())
        for k, b in enumerate(batches):
            key = evaluation.batch_key(config["seed"], env, part, k)
            hits, rows, _ = evaluate(variables["params"], variables["batch_stats"], b, key)
            correct, counted = correct + int(hits), counted + int(rows)
            if np.all(b["mask"]):
                logits = apply(variables, jnp.asarray(b["image"], jnp.float32), key)
                ours = np.argmax(np.asarray(logits), -1) == np.asarray(b["label"])
                assert int(ours.sum()) == int(hits)
                unpadded += 1
        assert correct / counted == record[f"env{env}_{part}_acc"], (env, part)
    assert unpadded
    return model, variables


def train_steps(model, variables, objective, hp, steps, batch, *, num_domains, lr, wd, key,
                algorithm="erm", rule_hp=None):
    """``steps`` jitted train steps of ``objective`` (hyperparameters ``hp``) under the
    update rule ``algorithm`` (a procedure too, with its hyperparameters ``rule_hp``), on
    ``batch(t)`` at step t, with the step key ``jax.random.key(key)``: the states (the
    initial one first) and each step's metrics."""
    import jax

    from sagm_jax.methods.procedures import make_procedure
    from sagm_jax.methods.registry import rule_names
    from sagm_jax.methods.update_rules import rule_optimizer
    from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

    if algorithm in rule_names("procedure"):
        opt = make_procedure(algorithm, rule_hp or {}, learning_rate=lr, weight_decay=wd,
                             num_domains=num_domains)
    else:
        opt = rule_optimizer(algorithm, rule_hp or {}, learning_rate=lr, weight_decay=wd)
    step = jax.jit(make_train_step(model, opt, algorithm=algorithm,
                                   method=StepMethod(objective, hp, num_domains)))
    states, metrics = [create_train_state(variables, opt, {})], []
    for t in range(steps):
        state, values = step(states[-1], batch(t), jax.random.key(key))
        states.append(state)
        metrics.append(values)
    return states, metrics


def procedure_steps(name, hp, params, forward_at, images, labels, steps, *, num_domains,
                    lr, wd):
    """``steps`` jitted updates of the whole-batch procedure ``name`` (hyperparameters
    ``hp``) on one batch, each with ``BatchPasses(forward_at, ...)`` and the key
    ``PRNGKey(t)``: per step, the parameters (NumPy), the procedure's state and the
    metrics (floats)."""
    import jax
    import jax.numpy as jnp

    from sagm_jax.methods import procedures

    procedure = procedures.make_procedure(name, hp, learning_rate=lr, weight_decay=wd,
                                          num_domains=num_domains)
    assert procedure.whole_batch

    def one(p, state, step, key):
        passes = procedures.BatchPasses(forward_at, jnp.asarray(images), jnp.asarray(labels),
                                        num_domains, step)
        updates, state, metrics = procedure.update(p, state, passes, key)
        return jax.tree.map(jnp.add, p, updates), state, metrics

    one = jax.jit(one)
    state, history = procedure.init(params), []
    for t in range(steps):
        params, state, metrics = one(params, state, jnp.int32(t), jax.random.PRNGKey(t))
        history.append((jax.tree.map(np.asarray, params), state,
                        {k: float(v) for k, v in metrics.items()}))
    return history


def record_params(monkeypatch, trajectory):
    """Keeps the parameters after every step of a run trained by ``train`` (its jitted
    train step wrapped): ``trajectory`` gets them in order."""
    import jax

    from sagm_jax.training import train

    build = train.data_parallel_train_step

    def recording(*args, **kwargs):
        step_fn = build(*args, **kwargs)

        def step(state, batch, key):
            state, metrics = step_fn(state, batch, key)
            trajectory.append(jax.device_get(state.params))
            return state, metrics

        return step

    monkeypatch.setattr(train, "data_parallel_train_step", recording)


def copy_run_with(workdir, folder, **config) -> str:
    """A copy of the run directory ``workdir`` in ``folder`` whose config.json has the
    values ``config``."""
    import json
    import shutil

    from sagm_jax.training import rundir

    shutil.copytree(workdir, folder)
    path = os.path.join(folder, rundir.CONFIG)
    with open(path) as f:
        values = json.load(f)
    values.update(config)
    rundir.write_json(path, values)
    return str(folder)
