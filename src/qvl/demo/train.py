"""Training of the small Qwen3-VL-shaped demo model from scratch on the synthetic tasks
(qvl.demo.data), with transformers' Qwen3VLForConditionalGeneration as the trainable module
(the reference, under the checkpoint's own names). Needs `transformers`; never imported by
the engine.

Deterministic from a seed: the initial weights come from it, and step k trains on items
k*B .. k*B+B-1 of the training stream drawn from it, so a run resumed from its saved state
(OUT/train/state.pt) goes on exactly as an uninterrupted one. The loss covers the answer
tokens only, over a sampled softmax (see `answer_loss`). Every `eval_every` steps a held-out
set (another seed's items) is answered greedily and its exact match logged, once the language
model trains (the checks change nothing in the run)."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean

import torch
import torch.nn.functional as F

from qvl.demo import probe
from qvl.demo.data import COLOURS, MIX, TASK_NAMES, Sample, follow_ups, named_shapes, sample
from qvl.eval.metrics import score
from qvl.processing.image import ImageProcessorConfig, ProcessedImage, preprocess
from qvl.processing.prompt import load_chat_template, tokenize_chat
from qvl.processing.tokenizer import Tokenizer
from qvl.synth import preset_config, write_side_files
from qvl.weights import write_shards

# The tiny test layout with a wider vision tower and more text layers: the 151,936-token
# embedding (tied, 128 wide) is 19.4 M of the ~22 M parameters.
DEMO_CHANGES = {
    "text_config": {"num_hidden_layers": 6, "intermediate_size": 512},
    "vision_config": {"hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "depth": 4,
                      "deepstack_visual_indexes": [1, 2, 3]},
}
PREPROCESSOR = {"size": {"shortest_edge": 4096}}  # pictures down to 4 image tokens are not enlarged
GENERATION = {"do_sample": False, "max_new_tokens": 256}  # a reader and a finder: greedy answers
HELD_OUT_SEED = 1_000_003  # held-out items: this seed plus the training seed
# The Qwen3.5 (hybrid Gated DeltaNet) layout of the same size: two groups of three linear-attention
# layers and one full-attention layer; its 248,320-token embedding is 31.8 M parameters.
QWEN3_5_CHANGES = {
    "text_config": {"num_hidden_layers": 8, "intermediate_size": 512},
    "vision_config": {"hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "depth": 4},
}


@dataclass(frozen=True)
class Architecture:
    preset: str  # qvl synth's
    changes: dict
    model_class: str  # transformers' trainable class
    config_class: str
    thinks: bool  # its template opens a reasoning block: answers start by closing it empty
    turns: int  # questions per scene in one training conversation (1 where the template re-renders
    # earlier turns otherwise than they were written, as Qwen3.5's drops their reasoning blocks)
    steps: int  # the run's steps, and of them the first that train the vision tower alone: in
    vision_steps: int  # with the finishing steps ~42 minutes on 2 cores (docs/demo-models.md: the aim is 45)
    finish_steps: int  # after `steps`: more on FINISH_MIX, at their own learning rate (see learning_rate)
    attend_layer: int | None  # the attention layer whose first head learns where the named shapes are
    # (see attention_loss; None: no such target)
    digit_targets: bool  # the vision probe teaches scene tokens their shape's coordinate digits (qvl.demo.probe)


ARCHITECTURES = {
    "qwen3-vl": Architecture("tiny", DEMO_CHANGES, "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", False, 3,
                             10300, 8000, 1300, 2, True),
    "qwen3.5": Architecture("qwen3.5-tiny", QWEN3_5_CHANGES, "Qwen3_5ForConditionalGeneration", "Qwen3_5Config", True,
                            1, 6800, 5000, 0, None, False),
}
# The finishing steps' tasks: weighted to the scenes, whose boxes and points the language model
# learns slowest (writing a coordinate it has to work out, not copy), with enough text strips to
# keep its reading.
FINISH_MIX = {"read": 0.3, "detect": 0.45, "point": 0.1, "ask": 0.15}
FINISH_WARMUP = 50
EMPTY_THOUGHT = "\n</think>\n\n"  # after the template's "<think>\n": no reasoning, then the answer


@dataclass(frozen=True)
class TrainConfig:
    steps: int | None = None  # None: the architecture's (ARCHITECTURES)
    batch_size: int = 16
    seed: int = 0
    lr: float = 2e-3
    vision_lr: float = 2.0  # the vision tower's (mergers included) learning rate, times `lr`
    probe_weight: float = 1.0  # the vision probe's loss (see qvl.demo.probe), added to the answers' loss
    attend_weight: float = 0.3  # the named shapes' attention target (see attention_loss), likewise
    vision_steps: int | None = None  # first steps: the vision tower learns from the probe alone (see train;
    # None: the architecture's)
    turns: int | None = None  # questions per scene in one training conversation (None: the architecture's)
    finish_steps: int | None = None  # the finishing steps after `steps` (None: the architecture's)
    finish_lr: float = 1e-3  # their peak learning rate
    finish_vision_lr: float = 0.0  # the vision tower's learning rate in them, times `finish_lr` (0: frozen)
    weight_decay: float = 0.01
    warmup: int = 200
    negatives: int = 2048  # random vocabulary rows in each step's softmax (see answer_loss)
    eval_every: int = 500
    eval_items: int = 32
    save_every: int = 250
    log_every: int = 10
    threads: int = 2
    groups: int = 3  # a batch runs as up to this many padded batches of similar lengths (see collate)
    minutes: float | None = None  # stop after this much wall time (state saved: run again to go on)
    arch: str = "qwen3-vl"  # qwen3-vl | qwen3.5 (ARCHITECTURES)

    @property
    def last_step(self) -> int:
        return self.steps + (self.finish_steps or 0)


@dataclass
class Encoded:
    ids: list[int]  # the prompt, then the answer and <|im_end|> (and more turns, each likewise)
    prompt_length: int  # of the first turn's prompt
    pixel_values: torch.Tensor  # [patches, 3*2*16*16]
    grid_thw: tuple[int, int, int]
    probe: dict | None = None  # the vision probe's targets for this picture (see qvl.demo.probe)
    answers: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each answer and its <|im_end|>
    attend: list[torch.Tensor] = field(default_factory=list)  # per answer about a scene: bool [len(ids)],
    # true on the image tokens of the shapes its question names


class Encoder:
    """A sample as the engine would see it: the checkpoint's image processor, chat template and
    tokenizer; answers as `answer_ids` spells them, then <|im_end|>."""

    def __init__(self, model_dir: Path, thinks: bool = False):
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.pad = self.tokenizer.token_id("<|endoftext|>")
        self.thought = self.tokenizer.encode(EMPTY_THOUGHT, special_tokens=True) if thinks else []
        self.template = load_chat_template(model_dir)
        self.image_cfg = ImageProcessorConfig.from_file(model_dir / "preprocessor_config.json")
        self.end = self.tokenizer.token_id("<|im_end|>")
        self.colour_ids = {name: self.tokenizer.encode(name, special_tokens=False)[0] for name in COLOURS}
        self.image_token_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
        opening = tokenize_chat(self.tokenizer, self.template, [{"role": "user", "content": "?"}], []).ids
        self.before = [*opening, *self.thought][-1]  # the token every answer follows

    def prompt(self, item: Sample, image: ProcessedImage | None = None) -> Encoded:
        """The item's prompt (`image`: its picture, if already processed)."""
        if image is None:
            image = preprocess(item.image, self.image_cfg)
        ids = self.conversation(item, image)
        return Encoded(ids, len(ids), image.pixel_values, image.grid_thw)

    def conversation(self, item: Sample, image: ProcessedImage, history: list[tuple[str, str]] = ()) -> list[int]:
        """The ids of the item's prompt (`image`: its picture, processed); with `history` (the
        previous answer, the next question) pairs, of the conversation up to its last question."""
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": item.question}]}]
        for answer, question in history:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        return tokenize_chat(self.tokenizer, self.template, messages, [image.num_tokens]).ids

    def answer_ids(self, item: Sample) -> list[int]:
        """The answer's tokens: a read answer one character at a time (each character's own
        tokens), any other answer as the tokenizer encodes it. The tokenizer merges letters
        ('Jijativo' is 'J' 'ij' 'ativo'); a token per character lets the model copy each one
        from the image token where it is drawn, which the small model learns several times
        faster than composing merged tokens. Its answers decode to the same text."""
        if item.task != "read":
            return self.tokenizer.encode(item.answer, special_tokens=False)
        return [i for char in item.answer for i in self.tokenizer.encode(char, special_tokens=False)]

    def probe_targets(self, item: Sample, image: ProcessedImage) -> dict:
        """The vision probe's targets for the item's picture (`image`, processed)."""
        answer = self.answer_ids(item)
        return probe.targets(item, image.grid_thw, answer, [self.tokenizer.token_bytes(t) for t in answer],
                             self.before, self.end, self.colour_ids)

    def pictures(self, items: list[Sample]) -> dict:
        """What a vision-only step reads of `items`: their pictures (`pixel_values`,
        `image_grid_thw`) and the probe's targets (`probe`), as collate gives them."""
        images = [preprocess(item.image, self.image_cfg) for item in items]
        return {"pixel_values": torch.cat([image.pixel_values for image in images]),
                "image_grid_thw": torch.tensor([image.grid_thw for image in images]),
                "probe": probe.collate([self.probe_targets(item, image) for item, image in zip(items, images)])}

    def __call__(self, item: Sample, more: list[tuple[str, str]] = ()) -> Encoded:
        """The item's question and answer, then the `more` (question, answer) turns about the
        same picture: the ids, where each answer is, and the probe's targets."""
        image = preprocess(item.image, self.image_cfg)
        encoded = self.prompt(item, image)
        encoded.probe = self.probe_targets(item, image)
        encoded.ids = encoded.ids + self.thought + self.answer_ids(item) + [self.end]
        encoded.answers = [(encoded.prompt_length, len(encoded.ids))]
        history, last = [], item.answer
        for question, reply in more:
            history.append((last, question))
            ids = self.conversation(item, image, history)
            if ids[: len(encoded.ids)] != encoded.ids:
                raise ValueError("the chat template renders an earlier turn differently in a longer conversation")
            encoded.ids = ids + self.tokenizer.encode(reply, special_tokens=False) + [self.end]
            encoded.answers.append((len(ids), len(encoded.ids)))
            last = reply
        if item.task != "read":
            ids = torch.tensor(encoded.ids)
            where = (ids == self.image_token_id).nonzero().flatten()  # the picture's tokens, row-major
            for question in [item.question, *(q for q, _ in more)][: len(encoded.answers)]:
                mask = torch.zeros(len(ids), dtype=torch.bool)
                mask[where] = probe.covered(item.image.size, image.grid_thw, named_shapes(question, list(item.marks)))
                encoded.attend.append(mask)
        return encoded


def collate(items: list[Encoded], image_token_id: int, pad: int, groups: int = 1) -> dict:
    """The items as up to `groups` right-padded batches of model inputs with `labels` (-100 on the
    prompt and the padding): ordered by length and cut where the padding is least (a batch mixes
    ~60-token strips with ~200-token scene conversations; one padded batch would be half padding).
    Also every picture's `pixel_values` and `image_grid_thw`, and the vision probe's targets
    (`probe`), in the groups' order."""
    order = sorted(range(len(items)), key=lambda i: len(items[i].ids))
    lengths = [len(items[i].ids) for i in order]
    cuts = _cuts(lengths, groups)
    chosen = [[items[i] for i in order[a:b]] for a, b in zip([0, *cuts], [*cuts, len(order)])]
    ordered = [e for group in chosen for e in group]
    return {"groups": [_padded(group, image_token_id, pad) for group in chosen],
            "pixel_values": torch.cat([e.pixel_values for e in ordered]),
            "image_grid_thw": torch.tensor([e.grid_thw for e in ordered]),
            "probe": probe.collate([e.probe for e in ordered]) if all(e.probe for e in ordered) else {}}


def _cuts(lengths: list[int], groups: int) -> list[int]:
    """Where to cut the ascending `lengths` into at most `groups` runs so that the padded total
    (each run's count times its longest) is least; fewer runs on a tie."""
    def padded(cuts: tuple[int, ...]) -> int:
        bounds = [0, *cuts, len(lengths)]
        return sum((end - start) * lengths[end - 1] for start, end in zip(bounds, bounds[1:]))
    options = (cuts for runs in range(groups) for cuts in itertools.combinations(range(1, len(lengths)), runs))
    return list(min(options, key=padded))


def _padded(items: list[Encoded], image_token_id: int, pad: int) -> dict:
    length = max(len(e.ids) for e in items)
    ids = torch.full((len(items), length), pad)
    labels = torch.full((len(items), length), -100)
    mask = torch.zeros((len(items), length), dtype=torch.long)
    for row, e in enumerate(items):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        for start, end in e.answers:
            labels[row, start:end] = torch.tensor(e.ids[start:end])
        mask[row, : len(e.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "mm_token_type_ids": (ids == image_token_id).int(),
            "pixel_values": torch.cat([e.pixel_values for e in items]),
            "image_grid_thw": torch.tensor([e.grid_thw for e in items]),
            "attend": [(row, start, end, F.pad(mask, (0, length - len(mask)))) for row, e in enumerate(items)
                       for (start, end), mask in zip(e.answers, e.attend) if mask.any()]}


def answer_loss(model, batch: dict[str, torch.Tensor], seen: set[int], negatives: torch.Tensor) -> tuple:
    """Cross-entropy of the answer tokens over a sampled vocabulary: every token any answer has
    used so far (`seen`), and `negatives` (random rows, new each step, so the rest of the
    151,936 tokens are pushed down too). The full softmax would cost ~50x more: its matrix
    product over the whole vocabulary dominates a step of this small model. Returns (loss,
    answer tokens)."""
    hidden, targets = [], []
    for group in batch["groups"]:
        inputs = {k: v for k, v in group.items() if k not in ("labels", "attend")}
        states = model.model(**inputs).last_hidden_state[:, :-1]  # [B, T-1, H]
        labels = group["labels"][:, 1:]
        keep = labels != -100
        hidden.append(states[keep])
        targets.append(labels[keep])
    hidden, targets = torch.cat(hidden), torch.cat(targets)  # [N, H], [N]
    seen.update(targets.tolist())
    vocabulary = torch.unique(torch.cat([torch.tensor(sorted(seen)), negatives]))  # sorted
    logits = hidden @ model.rows(vocabulary).T  # [N, V']: the tied embedding's rows
    return F.cross_entropy(logits, torch.searchsorted(vocabulary, targets)), len(targets)


def attention_loss(model, batch: dict) -> torch.Tensor:
    """How far the attended head is from looking at the named shapes: at each position that
    predicts an answer token about a scene, -log of the attention its first head gives the
    image tokens of the shapes the question names (see Encoded.attend), averaged per answer and
    over the batch's answers; from the attention weights of the last training forward of each
    group. 0 without such answers. Binding a name to where it is drawn is what the language
    model otherwise learns slowest: among several shapes it answered about one at random."""
    weights, model.attended = model.attended, []
    terms = []
    for group, attention in zip(batch["groups"], weights):  # attention [B, heads, T, T]
        for row, start, end, mask in group["attend"]:
            mass = attention[row, 0, start - 1:end - 1][:, mask].sum(-1)  # [answer tokens]
            terms.append(-torch.log(mass + 1e-6).mean())
    return torch.stack(terms).mean() if terms else torch.zeros(())


def build_model(config: dict, seed: int, arch: Architecture = ARCHITECTURES["qwen3-vl"]):
    """The trainable model from the seed, with the vision probe's heads as `model.probe` (not part
    of the checkpoint) fed by a hook on the merger, and (arch.attend_layer) a hook keeping that
    layer's attention weights in training forwards (`model.attended`: transformers' eager
    attention, the one that returns them)."""
    import transformers

    torch.manual_seed(seed)
    model_config = getattr(transformers, arch.config_class)(**config)
    if arch.attend_layer is not None:  # (the vision tower's too: the shipped model was trained so)
        model_config._attn_implementation = "eager"
        model_config.text_config._attn_implementation = "eager"
    model = getattr(transformers, arch.model_class)(model_config).float().train()
    if not config.get("tie_word_embeddings"):
        raise ValueError("the demo trainer reads one table for the inputs and the softmax: tied embeddings only")
    embed = model.model.language_model.embed_tokens
    model.rows = embed.weight.__getitem__  # the token embedding's rows by id (step_rows gathers them once a step)
    model.embedding_grad = None  # its gradient's buffer, kept from step to step (step_rows)
    embed.forward = lambda ids: model.rows(ids)
    model.attended = []
    if arch.attend_layer is not None:
        layer = model.model.language_model.layers[arch.attend_layer].self_attn
        layer.register_forward_hook(lambda attention, args, out: model.attended.append(out[1])
                                    if attention.training else None)
    model.probe = probe.VisionProbe(config["text_config"]["hidden_size"], arch.digit_targets)
    model.model.visual.merger.image_tokens = []  # emptied by probe_loss and at each training step
    model.model.visual.merger.register_forward_hook(_keep_image_tokens)
    model.model.visual.patch_embed.forward = _patch_embed_as_linear(model.model.visual.patch_embed)
    return model


def _keep_image_tokens(merger, args, output) -> None:
    merger.image_tokens.append(output)  # [merged tokens, hidden]: each call's pictures' tokens


def _patch_embed_as_linear(embed):
    """The patch embedding's Conv3d (kernel = stride = the patch) as the matrix product it is:
    the same function, several times faster to train on a CPU."""
    def forward(pixels: torch.Tensor) -> torch.Tensor:  # [patches, C*T*P*P] -> [patches, hidden]
        weight = embed.proj.weight
        return F.linear(pixels.reshape(-1, weight[0].numel()).to(weight.dtype), weight.flatten(1), embed.proj.bias)
    return forward


def probe_loss(model, batch: dict, negatives: torch.Tensor) -> torch.Tensor:
    """The vision probe's loss on the image tokens of the forward passes since the last call (the
    batch's pictures, in its groups' order), token ids scored over the batch's target tokens and
    `negatives`."""
    merger = model.model.visual.merger
    tokens, merger.image_tokens = torch.cat(merger.image_tokens), []
    vocabulary = torch.unique(torch.cat([model.probe.token_ids(batch["probe"]), negatives]))
    return model.probe.loss(tokens, batch["probe"], model.rows(vocabulary), vocabulary)


class _GatherRows(torch.autograd.Function):
    """weight[names]; its backward adds into weight.grad in place, `buffer` (zeroed, weight's
    shape) when weight has none, instead of handing autograd a new weight-sized gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, names: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(names)
        ctx.weight, ctx.buffer = weight, buffer
        return weight[names]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (names,) = ctx.saved_tensors
        if ctx.weight.grad is None:
            ctx.weight.grad = ctx.buffer
        ctx.weight.grad.index_add_(0, names, grad)
        return None, None, None


@contextmanager
def step_rows(model, ids: torch.Tensor, frozen: bool = False):
    """Within it, every read of the tied token embedding (the language model's inputs, the
    sampled softmax's rows, the probe's targets: `model.rows`) takes its rows from one table
    gathered once for the ids `ids` names (every id the step reads), and the backward adds the
    table's gradient into the embedding's, a buffer kept from step to step: a new 151,936-row
    gradient per read, or even per step, costs ~60 ms of page faults each (an eighth of a whole
    step). `frozen`: the table is gathered from the embedding detached (it gets no gradient: the
    vision-only steps, where it does not train)."""
    weight = model.model.language_model.embed_tokens.weight
    names = torch.unique(ids)  # sorted
    if frozen:
        table = weight.detach()[names]  # [len(names), hidden]
    else:
        if model.embedding_grad is None:
            model.embedding_grad = torch.zeros_like(weight)
        table = _GatherRows.apply(weight, names, model.embedding_grad.zero_())
    model.rows = lambda wanted: table[torch.searchsorted(names, wanted)]
    try:
        yield
    finally:
        model.rows = weight.__getitem__


def param_groups(model, config: TrainConfig) -> list[dict]:
    """AdamW's groups: the vision tower (its mergers and the probe included) at `vision_lr` times
    the learning rate, from the first step; the rest at the learning rate, from `vision_steps` on
    (`lr_scale`, `start`); in the finishing steps, the vision tower at `finish_vision_lr` times
    theirs (`finish_scale`)."""
    vision, text = [], []
    for name, p in model.named_parameters():
        (vision if name.startswith(("model.visual.", "probe.")) else text).append(p)
    return [{"params": text, "lr_scale": 1.0, "finish_scale": 1.0, "start": config.vision_steps,
             "weight_decay": config.weight_decay},
            {"params": vision, "lr_scale": config.vision_lr, "finish_scale": config.finish_vision_lr, "start": 0,
             "weight_decay": config.weight_decay}]


def learning_rate(config: TrainConfig, step: int, start: int = 0) -> float:
    """0 before `start`, then a linear warm-up and a cosine down to a tenth at step `steps`; the
    finishing steps after it start over from 0 with a warm-up (FINISH_WARMUP) to `finish_lr` and
    a cosine down to a tenth of it at the last step."""
    if step >= config.steps:
        return _warm_cosine(config.finish_lr, step - config.steps, config.last_step - config.steps, FINISH_WARMUP)
    if step < start:
        return 0.0
    return _warm_cosine(config.lr, step - start, config.steps - start, config.warmup)


def set_learning_rates(optimizer, config: TrainConfig, step: int) -> None:
    """Each of param_groups' groups at its learning rate for `step`."""
    for group in optimizer.param_groups:
        scale = group["finish_scale"] if step >= config.steps else group["lr_scale"]
        group["lr"] = learning_rate(config, step, group["start"]) * scale


def _warm_cosine(peak: float, step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def batches(encode: Encoder, config: TrainConfig, start: int, image_token_id: int) -> Iterator[dict]:
    """The batches of steps `start`..: step k's holds items k*B .. k*B+B-1 of the seed's stream
    (drawn by MIX, by FINISH_MIX in the finishing steps); a vision-only step's, their pictures
    and the probe's targets alone (Encoder.pictures)."""
    turns = config.turns or ARCHITECTURES[config.arch].turns
    for step in range(start, config.last_step):
        first = step * config.batch_size
        mix = FINISH_MIX if step >= config.steps else MIX
        items = [(first + j, sample(config.seed, first + j, mix=mix)) for j in range(config.batch_size)]
        if step < config.vision_steps:  # the probe's pictures alone
            yield encode.pictures([item for _, item in items])
            continue
        yield collate([encode(item, follow_ups(config.seed, index, item, turns - 1)) for index, item in items],
                      image_token_id, encode.pad, config.groups)


@torch.no_grad()
def held_out(model, encode: Encoder, config: TrainConfig, image_token_id: int) -> dict[str, dict[str, float]]:
    """Per task, the means of qvl eval's scores (exact; CER, box IoU or point hits) on held-out
    items answered greedily over the whole vocabulary, and `image_gain` (about 0 while the model
    ignores the pictures)."""
    model.eval()
    items = [sample(HELD_OUT_SEED + config.seed, i, TASK_NAMES[i % len(TASK_NAMES)]) for i in range(config.eval_items)]
    scored: dict[str, list[dict]] = {task: [] for task in TASK_NAMES}
    for item in items:
        e = encode.prompt(item)
        ids = torch.tensor([e.ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=e.pixel_values,
                             image_grid_thw=torch.tensor([e.grid_thw]), mm_token_type_ids=(ids == image_token_id).int(),
                             max_new_tokens=96, do_sample=False, eos_token_id=encode.end, pad_token_id=encode.pad)
        answer = encode.tokenizer.decode(out[0, ids.shape[1]:].tolist()).split("</think>")[-1].strip()
        scored[item.task].append(score(answer, item.answer, item.kind))
    result = {}
    for task, rows in scored.items():
        if rows:
            batch = collate([encode(item) for item in items if item.task == task], image_token_id, encode.pad)
            result[task] = {**{metric: round(fmean(s[metric] for s in rows), 3) for metric in rows[0]},
                            "image_gain": image_gain(model, batch)}
    model.train()
    return result


def image_gain(model, batch: dict) -> float:
    """The answer loss of `batch` (pictures of one size) with each item given the next one's
    picture minus with its own, over a fixed sampled vocabulary (the answers' tokens and 2,048
    rows of seed 0): what the pictures' content is worth, in nats per answer token."""
    (group,) = batch["groups"]
    grid = group["image_grid_thw"]
    if not (grid == grid[0]).all():
        raise ValueError("image_gain needs pictures of one size")
    negatives = torch.randint(0, model.lm_head.weight.shape[0], (2048,), generator=torch.Generator().manual_seed(0))
    seen = set(group["labels"][group["labels"] != -100].tolist())
    with step_rows(model, torch.cat([group["input_ids"].flatten(), negatives])):
        own, _ = answer_loss(model, batch, seen, negatives)
        shifted = group["pixel_values"].roll(-int(grid[0].prod()), dims=0)  # [patches, C]: item i gets i+1's
        other, _ = answer_loss(model, {"groups": [{**group, "pixel_values": shifted}]}, seen, negatives)
    return round((other - own).item(), 4)


def save_state(path: Path, model, optimizer, step: int, seen: set[int], used: set[int]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "seen": sorted(seen), "used": sorted(used)}, tmp)
    tmp.replace(path)


def write_weights(model, out: Path, tied: bool) -> None:
    """The weights under the official checkpoint names, in bf16 (as published)."""
    tensors = ((name, t.detach().to(torch.bfloat16).contiguous()) for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight") and not name.startswith("probe."))
    write_shards(tensors, out, {"format": "pt"})


def train(out: Path, config: TrainConfig) -> Path:
    """Train (or go on training) into `out`; writes the checkpoint there when the run ends."""
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    arch = ARCHITECTURES[config.arch]
    config = replace(config, steps=arch.steps if config.steps is None else config.steps,
                     vision_steps=arch.vision_steps if config.vision_steps is None else config.vision_steps,
                     finish_steps=arch.finish_steps if config.finish_steps is None else config.finish_steps)
    checkpoint = preset_config(arch.preset, arch.changes)
    write_side_files(out, checkpoint, generation=GENERATION, preprocessor=PREPROCESSOR)
    work = out / "train"
    work.mkdir(exist_ok=True)
    (work / "config.json").write_text(json.dumps(asdict(config), indent=2))
    encode = Encoder(out, arch.thinks)
    image_token_id = checkpoint["image_token_id"]
    model = build_model(checkpoint, config.seed, arch)
    optimizer = torch.optim.AdamW(param_groups(model, config), lr=config.lr, betas=(0.9, 0.98), fused=True)
    state_file, step, seen, used = work / "state.pt", 0, {encode.end}, set()
    if state_file.exists():
        state = torch.load(state_file, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for group, fresh in zip(optimizer.param_groups, param_groups(model, config)):  # the schedule: this config's
            group.update({k: v for k, v in fresh.items() if k != "params"})
        step, seen, used = state["step"], set(state["seen"]), set(state.get("used", ()))
        print(f"resuming at step {step} of {config.last_step}", flush=True)
    log = open(work / "log.jsonl", "a", encoding="utf-8")
    window = new_window()
    for batch in batches(encode, config, step, image_token_id):
        set_learning_rates(optimizer, config, step)
        negatives = torch.randint(0, checkpoint["text_config"]["vocab_size"], (config.negatives,),
                                  generator=torch.Generator().manual_seed(config.seed * 7_919 + step))
        model.model.visual.merger.image_tokens = []  # this step's pictures only (not the checks')
        vision_only = step < config.vision_steps  # the vision tower alone: ~3x cheaper a step
        reads = [model.probe.token_ids(batch["probe"]), negatives[:256]]
        if not vision_only:
            inputs = torch.cat([g["input_ids"].flatten() for g in batch["groups"]])
            used.update(inputs.unique().tolist())
            reads += [inputs, torch.tensor(sorted(seen), dtype=torch.long), negatives]
        with step_rows(model, torch.cat(reads), frozen=vision_only):
            if vision_only:
                model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
                loss, attended, answer_tokens = torch.zeros(()), torch.zeros(()), 0
            else:
                loss, answer_tokens = answer_loss(model, batch, seen, negatives)
                attended = attention_loss(model, batch)
            probed = probe_loss(model, batch, negatives[:256])
        optimizer.zero_grad(set_to_none=True)
        (loss + config.attend_weight * attended + config.probe_weight * probed).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        window["loss"] += loss.item()
        window["attend"] += attended.item()
        window["probe"] += probed.item()
        window["steps"] += 1
        window["answer_tokens"] += answer_tokens
        window["tokens"] += sum(int(g["attention_mask"].sum()) for g in batch.get("groups", ()))  # the language model's
        if step % config.log_every == 0 or step == config.last_step:
            record = report(window, step, config, time.perf_counter() - started)
            log.write(json.dumps(record) + "\n")
            log.flush()
            window = new_window()
        if step > config.vision_steps and step % config.eval_every == 0 or step in (config.steps, config.last_step):
            record = {"step": step, "held_out": held_out(model, encode, config, image_token_id)}
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()
        out_of_time = config.minutes is not None and time.perf_counter() - started > 60 * config.minutes
        if step % config.save_every == 0 or step in (config.steps, config.last_step) or out_of_time:
            save_state(state_file, model, optimizer, step, seen, used)
        if out_of_time:
            print(f"stopped after {config.minutes} minutes at step {step}: run the same command to go on", flush=True)
            break
    log.close()
    write_weights(model, out, checkpoint["tie_word_embeddings"])
    (work / "used_tokens.json").write_text(json.dumps(sorted(used)))
    return out


def new_window() -> dict:
    """What report() sums over the steps between two log lines."""
    return {"loss": 0.0, "attend": 0.0, "probe": 0.0, "steps": 0, "answer_tokens": 0, "tokens": 0,
            "started": time.perf_counter()}


def report(window: dict, step: int, config: TrainConfig, elapsed: float) -> dict:
    seconds = time.perf_counter() - window["started"]
    record = {"step": step, "loss": round(window["loss"] / window["steps"], 4),
              "attend_loss": round(window["attend"] / window["steps"], 4),
              "probe_loss": round(window["probe"] / window["steps"], 4),
              "lr": learning_rate(config, step - 1, config.vision_steps),
              "tokens_per_s": round(window["tokens"] / seconds, 1),
              "answer_tokens_per_s": round(window["answer_tokens"] / seconds, 1),
              "s_per_step": round(seconds / window["steps"], 3), "elapsed_s": round(elapsed, 1)}
    print(json.dumps(record), flush=True)
    return record
