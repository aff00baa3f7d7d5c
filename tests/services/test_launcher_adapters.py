"""Several models and adapters in one local stack: each ``--lora-modules`` adapter goes to the
workers of the served model it fits (by its shapes; among models of one shape, by the base
model it names; else ``@MODEL``), and one that fits none, or several without a pick, stops
``tandem serve`` before anything starts, naming the models tried."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli.main import main
from services.launcher.adapters import assign_adapters
from services.launcher.placement import Placement
from services.launcher.stack import Stack, StackConfig
from tests.conftest import make_random_model_dir
from tests.lora_adapters import make_adapter
from tests.stack.test_e2e_stack import MODEL


@pytest.fixture(scope="module")
def folders(smol_dir, tmp_path_factory) -> dict[str, Path]:
    """Four models (SmolLM2, two random Llamas of one smaller shape and a wider one), an
    adapter of SmolLM2 and one of the first small model (its base_model_name_or_path: that
    folder)."""
    base = tmp_path_factory.mktemp("adapter-models")
    tiny, twin = (
        make_random_model_dir(base / name, smol_dir, "llama", seed=seed).rename(base / name / name)
        for name, seed in (("tiny", 5), ("twin", 6))
    )
    wide = make_random_model_dir(base / "wide", smol_dir, "llama", hidden_size=256)
    return {
        MODEL: smol_dir,
        "tiny": tiny,
        "wide": wide,
        "twin": twin,
        "smol_lora": make_adapter(smol_dir, base / "s", r=4, alpha=8, targets=["q_proj"], seed=1),
        "tiny_lora": make_adapter(tiny, base / "t", r=4, alpha=8, targets=["v_proj"], seed=2),
    }


def with_base(src: Path, dest: Path, base: str | None) -> Path:
    """A copy of adapter ``src`` whose config names ``base`` (None: no base model)."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def test_each_adapter_goes_to_the_model_its_shapes_fit(folders):
    models = {MODEL: str(folders[MODEL]), "tiny": str(folders["tiny"])}
    s, t = f"s={folders['smol_lora']}", f"t={folders['tiny_lora']}"
    assert assign_adapters([t, s], models) == {MODEL: (s,), "tiny": (t,)}
    assert assign_adapters([], models) == {MODEL: (), "tiny": ()}


def test_models_of_one_shape_are_told_apart_by_the_base_model_named(folders, tmp_path):
    models = {"tiny": str(folders["tiny"]), "twin": str(folders["twin"])}
    t = f"t={folders['tiny_lora']}"  # names the tiny folder by its path
    assert assign_adapters([t], models) == {"tiny": (t,), "twin": ()}
    hub = with_base(folders["tiny_lora"], tmp_path / "hub", "some-org/twin")  # by served name
    assert assign_adapters([f"h={hub}"], models)["twin"] == (f"h={hub}",)
    other = with_base(folders["tiny_lora"], tmp_path / "other", "some-org/another-model")
    with pytest.raises(ValueError, match=r"fits several served models \(tiny, twin\)") as e:
        assign_adapters([f"o={other}"], models)
    assert "'some-org/another-model' names none of them" in str(e.value)
    assert f"o={other}@MODEL" in str(e.value)
    bare = with_base(folders["tiny_lora"], tmp_path / "bare", None)
    with pytest.raises(ValueError, match="names no base model"):
        assign_adapters([f"b={bare}"], models)
    # NAME=PATH@MODEL picks one; it must be served and fit.
    assert assign_adapters([f"o={other}@twin"], models)["twin"] == (f"o={other}",)
    with pytest.raises(ValueError, match="no served model 'nope'.*served: tiny, twin"):
        assign_adapters([f"o={other}@nope"], models)
    with pytest.raises(
        ValueError,
        match=r"@tiny: adapter 's' does not fit the served model \(another base model\?\)",
    ):
        assign_adapters([f"s={folders['smol_lora']}@tiny"], models)


def test_an_adapter_that_fits_no_model_names_the_models_tried(folders, tmp_path):
    models = {"tiny": str(folders["tiny"]), "twin": str(folders["twin"])}
    with pytest.raises(ValueError, match=r"fits none of the served models \(tiny, twin\)") as e:
        assign_adapters([f"s={folders['smol_lora']}"], models)
    assert str(e.value).count("does not fit the served model") == 1  # one reason for both
    other = {MODEL: str(folders[MODEL]), "wide": str(folders["wide"])}
    with pytest.raises(ValueError, match=rf"fits none of the served models \({MODEL}, wide\)") as e:
        assign_adapters([f"t={folders['tiny_lora']}"], other)
    assert f"{MODEL}: adapter 't' does not fit" in str(e.value)  # each model's reason
    assert "wide: adapter 't' does not fit" in str(e.value)
    with pytest.raises(ValueError, match="is not a directory"):
        assign_adapters([f"s={tmp_path / 'missing'}"], models)
    with pytest.raises(ValueError, match="has a served model's name"):
        assign_adapters([f"tiny={folders['tiny_lora']}"], models)
    with pytest.raises(ValueError, match="given twice"):
        assign_adapters([f"t={folders['tiny_lora']}", f"t={folders['tiny_lora']}"], models)


def test_each_worker_is_given_only_its_models_adapters(folders, tmp_path):
    s, t = f"s={folders['smol_lora']}", f"t={folders['tiny_lora']}"
    config = StackConfig(
        str(folders[MODEL]), str(tmp_path), extra_models=(f"tiny={folders['tiny']}",),
        lora_modules=(t, s),
    )  # fmt: skip
    stack = Stack(config)
    given = {
        name: [a for a in stack._worker_args(*name.split("-"), Placement()) if "lora" in a]
        for name in ("prefill-0", "decode-0", "prefill-1", "decode-1")
    }
    assert given["prefill-0"] == given["decode-0"] == [f"--lora-modules={s}"]
    assert given["prefill-1"] == given["decode-1"] == [f"--lora-modules={t}"]


def test_serve_stops_before_starting_anything_when_an_adapter_fits_no_model(folders, tmp_path):
    run = tmp_path / "run"
    argv = [
        "serve", "--model", str(folders["tiny"]), "--model", f"twin={folders['twin']}",
        "--lora-modules", f"s={folders['smol_lora']}", "--gpus", "none", "--run-dir", str(run),
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"fits none of the served models \(tiny, twin\)"):
        main(argv)
    assert not run.exists()  # no logs, no etcd: nothing started
