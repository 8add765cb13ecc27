"""The demo tasks and trainer: a seed draws the same items every time, in qvl eval's format with
answers that match their pictures; training is deterministic from its seed, a resumed run ends
bit-identical to an uninterrupted one, and what it writes loads and answers in qvl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qvl.demo.__main__ import main
from qvl.demo.data import COLOURS, SCENE_SIZE, sample, write_set
from qvl.eval.labels import read_labels
from qvl.grounding import parse


def test_a_seed_draws_the_same_items():
    for index, task in enumerate(("read", "detect", "point", "ask")):
        a, b = sample(3, index, task), sample(3, index, task)
        assert (a.question, a.answer, a.kind) == (b.question, b.answer, b.kind)
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert [sample(3, i).answer for i in range(8)] != [sample(4, i).answer for i in range(8)]


def test_every_character_of_a_text_strip_is_drawn(monkeypatch):
    """No string is drawn in a font without its glyphs (Pillow's Aileron has no euro, pound or yen
    sign: such a price would show boxes, and no reader could tell its currency)."""
    from qvl.demo import data

    assert not data.has_glyph((None, "Aileron"), "€") and data.has_glyph((None, "Aileron"), "$")
    assert all(data.has_glyph(data.LATIN_FONTS[0], c) for c in "€£¥$")
    faces = []
    original = data.font
    monkeypatch.setattr(data, "font", lambda which, size: faces.append(which) or original(which, size))
    prices = 0
    for i in range(300):
        faces.clear()
        item = sample(5, i, "read")
        prices += any(c in item.answer for c in "€£¥")
        assert all(data.has_glyph(faces[0], c) for c in item.answer), (i, item.answer, faces[0])
    assert prices > 10


def test_grounding_answers_match_their_pictures():
    """Every box encloses its shape's pixels (not the background) and every point lies on one."""
    for i in range(12):
        item = sample(9, i, "detect")
        boxes, _ = parse(item.answer)
        pixels = np.asarray(item.image).astype(int)
        background = pixels[0, 0]
        for box in boxes:
            x1, y1, x2, y2 = (round(v * side / 1000) for v, side in
                              zip((box.x1, box.y1, box.x2, box.y2), SCENE_SIZE * 2))
            inside = pixels[y1:y2, x1:x2]
            assert np.abs(inside - background).sum(-1).max() > 100, (i, box)  # the shape's colour is there
            assert box.label in item.question
        _, points = parse(sample(9, i, "point").answer)
        assert points and all(0 <= p.x <= 1000 and 0 <= p.y <= 1000 for p in points)


def test_data_command_writes_a_set_qvl_eval_reads(tmp_path, capsys):
    assert main(["data", "--out", str(tmp_path), "--seed", "2", "--count", "6"]) == 0
    labels = read_labels(str(tmp_path))
    assert len(labels) == 6 and {label.kind for label in labels} <= {"text", "boxes", "points"}
    rows = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert all((tmp_path / row["image"]).is_file() for row in rows)
    assert main(["data", "--out", str(tmp_path), "--count", "0"]) == 1
    capsys.readouterr()
    for arch in ([], ["--arch", "qwen3.5"]):  # the Qwen3.5 one ships compressed: unpacked into the cache
        assert main(["path", *arch]) == 0
        ready = Path(capsys.readouterr().out.strip())
        assert (ready / "model.safetensors").is_file() and (ready / "tokenizer.json").is_file()


def test_packing_sets_the_rows_training_never_read_to_their_mean():
    import torch

    from qvl.demo.pack import collapse_unused_rows

    embedding = torch.randn(10, 4)
    packed = collapse_unused_rows(embedding, [1, 3])
    assert torch.equal(packed[[1, 3]], embedding[[1, 3]])
    others = [0, 2, 4, 5, 6, 7, 8, 9]
    assert torch.allclose(packed[others], embedding[others].mean(0).expand(8, 4))


def test_training_targets_spell_each_answer():
    """A read answer is trained one token per character (decoding to the text); other answers
    as the tokenizer spells them."""
    from qvl.demo import shipped
    from qvl.demo.train import Encoder

    encode = Encoder(shipped.folder())
    for i in range(12):
        item = sample(5, i, "read")
        ids = encode.answer_ids(item)
        assert encode.tokenizer.decode(ids) == item.answer
        assert len(ids) == len(item.answer)  # every character here is one token
        encoded = encode(item)
        start, end = encoded.answers[0]
        assert encoded.ids[start:end] == [*ids, encode.end]
    item = sample(5, 0, "detect")
    assert encode.answer_ids(item) == encode.tokenizer.encode(item.answer, special_tokens=False)


def test_the_probe_teaches_a_scene_token_the_digits_its_shape_is_written_with():
    """Each image token on a shape is taught the hundreds and tens of the numbers the answers
    write for that shape (box, then centre); the background has no shape and no digits."""
    from qvl.demo.probe import DIGITS, NUMBERS, targets

    for i in range(6):
        item = sample(5, i, "detect")
        boxes, _ = parse(item.answer)
        target = targets(item, (1, 12, 12), [], [], 0, 0, dict.fromkeys(COLOURS, 0))
        on = target["shape"] > 0
        assert on.any() and (~on).any() and not target["digits"][~on].any()
        written = {tuple(int(v) for v in (b.x1, b.y1, b.x2, b.y2)) for b in boxes}
        taught = {tuple(100 * row[2 * k] + 10 * row[2 * k + 1] for k in range(4)) for row in target["digits"][on].tolist()}
        assert target["digits"].shape[1] == NUMBERS * DIGITS
        assert {tuple(v // 10 * 10 for v in box) for box in written} <= taught  # every answered shape's


def test_a_batch_in_length_groups_trains_as_one():
    """A training batch runs as padded groups of similar lengths: every item once, less padding,
    and the same losses (answers and vision probe) as one padded batch."""
    from qvl.demo import shipped
    from qvl.demo.data import follow_ups
    from qvl.demo.train import ARCHITECTURES, Encoder, answer_loss, build_model, collate, probe_loss
    from qvl.synth import preset_config

    arch = ARCHITECTURES["qwen3-vl"]
    checkpoint = preset_config(arch.preset, arch.changes)
    encode = Encoder(shipped.folder())
    items = [(i, sample(3, i)) for i in range(8)]
    encoded = [encode(item, follow_ups(3, i, item, 2)) for i, item in items]
    assert len({len(e.ids) for e in encoded}) > 2  # strips and longer scene conversations
    model = build_model(checkpoint, seed=0, arch=arch)
    negatives = torch.arange(100, 2148)
    losses, padded = {}, {}
    for groups in (1, 3):
        batch = collate(encoded, checkpoint["image_token_id"], encode.pad, groups)
        assert sorted(len(ids[ids != encode.pad]) for g in batch["groups"] for ids in g["input_ids"]) == \
            sorted(len(e.ids) for e in encoded)
        padded[groups] = sum(g["input_ids"].numel() for g in batch["groups"])
        with torch.no_grad():
            answers, count = answer_loss(model, batch, set(), negatives)
            losses[groups] = (answers.item(), count, probe_loss(model, batch, negatives[:256]).item())
    assert padded[3] < padded[1]
    assert losses[3][1] == losses[1][1]
    assert losses[3][0] == pytest.approx(losses[1][0], rel=1e-5)
    assert losses[3][2] == pytest.approx(losses[1][2], rel=1e-5)


def test_the_attention_target_is_the_shapes_each_question_names():
    """Every answer about a scene marks the image tokens under the shapes its question names (a
    "red square": those; "circle": every circle), and nothing else; training on that target
    moves the attended head's look there."""
    from qvl.demo import shipped
    from qvl.demo.data import Shape, follow_ups, named_shapes
    from qvl.demo.probe import covered
    from qvl.demo.train import ARCHITECTURES, Encoder, answer_loss, attention_loss, build_model, collate
    from qvl.synth import preset_config

    red, blue = Shape("square", "red", (0, 0, 30, 30)), Shape("square", "blue", (100, 100, 130, 130))
    circle = Shape("circle", "red", (150, 10, 180, 40))
    assert named_shapes("Locate every instance ... 'red square'.", [red, blue, circle]) == [red]
    assert named_shapes("How many squares are there?", [red, blue, circle]) == [red, blue]
    assert covered(SCENE_SIZE, (1, 12, 12), [red]).nonzero().flatten().tolist() == [0]  # one of 6 x 6 cells

    encode = Encoder(shipped.folder())
    index, item = next((i, it) for i in range(50) if len((it := sample(4, i, "detect")).marks) >= 3)
    more = follow_ups(4, index, item, 2)
    encoded = encode(item, more)
    image = torch.tensor(encoded.ids) == encode.image_token_id
    assert len(encoded.attend) == len(encoded.answers) == 1 + len(more)
    for question, mask in zip([item.question, *(q for q, _ in more)], encoded.attend):
        named = named_shapes(question, list(item.marks))
        assert mask.any() and not mask[~image].any()
        assert torch.equal(mask[image], covered(item.image.size, encoded.grid_thw, named))
    assert encode(sample(4, 0, "read")).attend == []

    arch = ARCHITECTURES["qwen3-vl"]
    checkpoint = preset_config(arch.preset, arch.changes)
    model = build_model(checkpoint, seed=0, arch=arch)
    batch = collate([encoded], checkpoint["image_token_id"], encode.pad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        answer_loss(model, batch, set(), torch.arange(100, 612))
        loss = attention_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8, losses


def test_the_finishing_steps_train_the_language_model_on_scenes():
    """After `steps`, the finishing steps draw mostly scenes, restart the language model's
    learning rate with a warm-up to `finish_lr` and a cosine to a tenth of it, and keep the
    vision tower (which already reads the boxes) frozen."""
    from collections import Counter

    from qvl.demo.data import MIX
    from qvl.demo.train import FINISH_MIX, FINISH_WARMUP, TrainConfig, param_groups, set_learning_rates

    config = TrainConfig(steps=1000, vision_steps=600, finish_steps=300, finish_lr=1e-3)
    model = torch.nn.Module()  # the trainable model's two kinds of parameters, by their names
    model.model = torch.nn.Module()
    model.model.visual, model.model.language_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(param_groups(model, config), lr=config.lr)

    def rates(step):
        set_learning_rates(optimizer, config, step)
        return [g["lr"] for g in optimizer.param_groups]  # text, vision

    assert rates(0)[0] == 0 and rates(0)[1] > 0  # the vision tower first
    assert rates(999)[0] == pytest.approx(config.lr / 10, rel=0.01)
    assert rates(1000) == [pytest.approx(1e-3 / FINISH_WARMUP), 0.0]
    assert rates(1000 + FINISH_WARMUP - 1) == [pytest.approx(1e-3), 0.0]
    assert rates(1299) == [pytest.approx(1e-4, rel=0.01), 0.0]

    scenes = Counter(sample(0, i, mix=FINISH_MIX).task != "read" for i in range(400))[True]
    before = Counter(sample(0, i, mix=MIX).task != "read" for i in range(400))[True]
    assert scenes > 1.7 * before


@pytest.mark.slow  # builds and trains the 23.5 M-parameter model for a few steps, three times
def test_training_is_deterministic_resumes_exactly_and_loads_in_qvl(tmp_path):
    from qvl.cli import main as qvl
    from qvl.demo.train import TrainConfig, train

    config = TrainConfig(steps=2, batch_size=2, eval_items=4, save_every=1, log_every=1, vision_steps=1,
                         finish_steps=1)
    straight = train(tmp_path / "straight", config)
    train(tmp_path / "resumed", TrainConfig(**{**config.__dict__, "minutes": 0.0}))  # stops after step 1
    resumed = train(tmp_path / "resumed", config)
    assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    log = [json.loads(line) for line in (straight / "train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in log if "held_out" in r] == [2, 3]  # the end of each phase

    write_set(tmp_path / "set", seed=1, count=2)
    assert qvl(["eval", str(tmp_path / "set"), "--model", str(straight), "--weights", "fp32", "--threads", "1",
                "--max-new-tokens", "4"]) == 0
