"""The model zoo: real architectures from transformers' configs and torchvision's builders, random weights,
exported as users do.

Nothing is downloaded: each entry builds its architecture with seeded random weights, in a full size (what the
benchmark times) and a tiny one (what the tests convert). `load` exports it the way users do (`torch.onnx.export`
with the TorchScript or the dynamo exporter, or `torch.export` into `from_torch`) and imports it into Relax. The
CNNs are transformers' ResNet, MobileNetV2, EfficientNet, ConvNeXt, RegNet, BiT, LeViT and PoolFormer,
torchvision's MobileNetV3 (which transformers lacks) and timm's MixNet-S and EfficientViT-B0; the vision transformers
ViT, Swin and CLIP's image tower take images too; wav2vec2 is the audio model; Qwen3-MoE is
the mixture of experts (exported with transformers' `batched_mm` experts, the implementation the exporters
translate; PyTorch runs its default, `grouped_mm`, faster in PyTorch and the same products). Needs the
`zoo` extra (torch, torchvision, timm, transformers): import this module only where it is used.
"""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm
import torch
import torchvision
import transformers as hf
import tvm

from .. import frontend
from ..errors import OptionError
from .pytorch import avoid_broken_onednn_amx

EXPORTERS = ("torchscript", "dynamo", "torch.export")
avoid_broken_onednn_amx()  # before any torch op of this process: PyTorch's AMX dies on some VMs
OPSET = 17
DYNAMIC_AXES = {"cnn": {0: "batch"}, "transformer": {0: "batch", 1: "sequence"},
                "audio": {0: "batch", 1: "samples"}}  # per kind of model
INPUT_NAMES = {"cnn": ["pixel_values"], "transformer": ["input_ids", "attention_mask"],
               "audio": ["input_values"]}  # the transformers models' keyword per positional input


@dataclass(frozen=True)
class Shape:
    """The input of a zoo model: images (batch, 3, size, size), token ids (batch, length) or audio samples (batch,
    length)."""

    batch: int
    size: int


@dataclass(frozen=True)
class ZooEntry:
    """One architecture: how to build it at full and tiny size, and what it takes as input."""

    name: str
    kind: str  # "cnn", "transformer" or "audio": images; token ids and an attention mask; a waveform
    config: Callable[[bool], object]  # tiny -> a transformers config, or a torchvision or timm builder's keywords
    model_class: str  # the transformers class that the config builds, or a torchvision or timm model's name
    output: str | None  # the attribute of the model's output returned as the zoo model's one output; None: the
    # model returns one tensor (torchvision, timm)
    full: Shape
    tiny: Shape
    batch_norm: str = ""  # a CNN with batch norms, given trained-looking weights instead of the library's init and
    # "spread" statistics (random, spread out) or "measured" ones (over random images: see _measured_statistics)
    library: str = "transformers"  # or "torchvision" or "timm"
    trim_tiny: Callable[[torch.nn.Module], None] | None = None  # shortens the tiny model, for a library builder
    # whose keywords cannot (timm's MixNet has no depth multiplier)


def _resnet50(tiny: bool):
    if tiny:
        return hf.ResNetConfig(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                               layer_type="bottleneck", num_labels=10)
    return hf.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                           layer_type="bottleneck", num_labels=1000)


def _resnet18(tiny: bool):
    if tiny:
        return hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                               layer_type="basic", num_labels=10)
    return hf.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                           layer_type="basic", num_labels=1000)


def _mobilenet_v2(tiny: bool):
    return hf.MobileNetV2Config(depth_multiplier=0.35 if tiny else 1.0, image_size=64 if tiny else 224,
                                num_labels=10 if tiny else 1000)


def _efficientnet_b0(tiny: bool):
    return hf.EfficientNetConfig(width_coefficient=0.25 if tiny else 1.0, depth_coefficient=0.25 if tiny else 1.0,
                                 image_size=64 if tiny else 224, hidden_dim=320 if tiny else 1280,
                                 num_labels=10 if tiny else 1000)


def _convnext_tiny(tiny: bool):
    if tiny:
        return hf.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10)
    return hf.ConvNextConfig(num_labels=1000)  # the defaults are ConvNeXt-T


def _regnet_y(tiny: bool):
    if tiny:
        return hf.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], groups_width=8,
                               layer_type="y", num_labels=10)
    return hf.RegNetConfig(embedding_size=32, hidden_sizes=[48, 104, 208, 440], depths=[1, 3, 6, 6], groups_width=8,
                           layer_type="y", num_labels=1000)  # RegNetY-400MF: grouped 3x3 convs, groups of 8


def _bit_r50(tiny: bool):
    if tiny:
        return hf.BitConfig(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                            layer_type="bottleneck", num_groups=8, num_labels=10)
    return hf.BitConfig(layer_type="bottleneck", depths=[3, 4, 6, 3], num_labels=1000)  # BiT-R50x1: weight
    # standardized convs (a batch norm of each weight in the graph) and group norms


def _levit_128s(tiny: bool):
    if tiny:
        return hf.LevitConfig(image_size=64, hidden_sizes=[32, 64, 96], num_attention_heads=[2, 2, 2],
                              depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10)
    return hf.LevitConfig(num_labels=1000)  # the defaults are LeViT-128S: a batch norm after every linear layer


def _poolformer_s12(tiny: bool):
    if tiny:
        return hf.PoolFormerConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=64, num_labels=10)
    return hf.PoolFormerConfig(num_labels=1000)  # the defaults are PoolFormer-S12: pooling token mixers between
    # one-group norms (GroupNorm(1, C))


def _mobilenet_v3_large(tiny: bool):
    return {"width_mult": 0.25 if tiny else 1.0, "num_classes": 10 if tiny else 1000}  # hardswish, squeeze-excite
    # with hardsigmoid gates, depthwise 3x3 and 5x5 convs


def _mixnet_s(tiny: bool):
    return {"num_classes": 10 if tiny else 1000}  # timm's MixNet-S: depthwise convs of 3-9 taps over channel
    # groups (split, convs, concatenation), grouped pointwise convs, squeeze-excite, SiLU and ReLU


def _first_block_of_each_stage(model) -> None:
    """A timm EfficientNet-family model with each stage cut to its first block, the one that changes the width
    (the blocks after it keep it, so the stages still fit): MixNet-S's 16 blocks to 6, every kind of mixed,
    grouped and squeeze-excite block still there."""
    model.blocks = torch.nn.Sequential(*(stage[:1] for stage in model.blocks))


def _vit_s16(tiny: bool):
    if tiny:
        return hf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                            image_size=32, patch_size=8, num_labels=10)
    return hf.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                        image_size=224, patch_size=16, num_labels=1000)


def _swin_t(tiny: bool):
    if tiny:
        return hf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                             window_size=4, num_labels=10)
    return hf.SwinConfig(num_labels=1000)  # the defaults are Swin-T: shifted-window attention (rolls, window
    # partitions, a relative position bias gathered per window) and patch merging


def _clip_vit_b32(tiny: bool):
    if tiny:
        return hf.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    return hf.CLIPVisionConfig()  # the defaults are CLIP's ViT-B/32 image tower: quick GELU, pre-norm, a class token


def _cait_xxs24(tiny: bool):
    if tiny:
        return {"img_size": 64, "num_classes": 10, "depth": 2, "depth_token_only": 1}
    return {"num_classes": 1000}  # timm's CaiT-XXS24: talking-heads attention (linear mixes across the 4 heads of
    # every attention map, before and after its softmax), LayerScale, class attention over the patch tokens


def _efficientvit_b0(tiny: bool):
    return {"num_classes": 10 if tiny else 1000}  # timm's EfficientViT-B0 (MIT): ReLU linear attention (a division
    # by a per-token sum), hardswish, depthwise convs of 16-64 channels


def _bert(tiny: bool):
    if tiny:
        return hf.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128)
    return hf.BertConfig(num_hidden_layers=6)  # BERT-base widths, 6 layers


def _distilbert(tiny: bool):
    if tiny:
        return hf.DistilBertConfig(vocab_size=512, dim=64, n_layers=2, n_heads=2, hidden_dim=128)
    return hf.DistilBertConfig()


def _gpt2(tiny: bool):
    if tiny:
        return hf.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    return hf.GPT2Config(n_layer=4)


def _llama(tiny: bool):
    if tiny:
        return hf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    # a LLaMA-style decoder of BERT-base width: RMS norms, rotary embeddings, a SiLU-gated MLP, grouped-query
    # attention (12 query heads sharing 4 key/value heads), a causal mask; 4 layers
    return hf.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                          num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512)


def _qwen3_moe(tiny: bool):
    if tiny:
        return hf.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    # Qwen3-MoE's design at BERT-base width: 4 layers, 64 experts of 256 columns and top 8 (Qwen3-30B-A3B: 128 of
    # 768, top 8), grouped-query attention with normed queries and keys, a causal mask
    return hf.Qwen3MoeConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                             num_experts=64, num_experts_per_tok=8, max_position_embeddings=512)


def _t5_encoder(tiny: bool):
    if tiny:
        return hf.T5Config(vocab_size=512, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2)
    return hf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)  # t5-small's encoder


def _deberta_v2(tiny: bool):
    if tiny:
        return hf.DebertaV2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=64, relative_attention=True,
                                  position_buckets=16, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                                  norm_rel_ebd="layer_norm", share_att_key=True)
    # DeBERTa-v3-base's design, 6 of its 12 layers and a 32000-token vocabulary: disentangled attention (content to
    # position and position to content scores gathered by bucketed relative distance)
    return hf.DebertaV2Config(vocab_size=32000, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                              intermediate_size=3072, relative_attention=True, position_buckets=256,
                              pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
                              share_att_key=True, max_relative_positions=-1)


def _gemma2(tiny: bool):
    if tiny:
        return hf.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                               sliding_window=8)
    # Gemma 2's design at BERT-base width, 4 layers: tanh soft-capped attention scores, sliding-window layers, a
    # tanh-GELU gated MLP, norms after each block as well as before
    return hf.Gemma2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                           num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=512)


def _wav2vec2(tiny: bool):
    if tiny:
        return hf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                                 num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return hf.Wav2Vec2Config(num_hidden_layers=4)  # wav2vec2-base: its conv1d feature encoder (a group norm after
    # the first), a grouped positional conv, 4 of its 12 transformer layers


ZOO = {entry.name: entry for entry in [
    ZooEntry("resnet50", "cnn", _resnet50, "ResNetForImageClassification", "logits", Shape(1, 224), Shape(1, 64),
             batch_norm="spread"),
    ZooEntry("resnet18", "cnn", _resnet18, "ResNetForImageClassification", "logits", Shape(1, 224), Shape(1, 64),
             batch_norm="spread"),
    ZooEntry("mobilenet_v2", "cnn", _mobilenet_v2, "MobileNetV2ForImageClassification", "logits",
             Shape(1, 224), Shape(1, 64), batch_norm="spread"),
    ZooEntry("efficientnet_b0", "cnn", _efficientnet_b0, "EfficientNetForImageClassification", "logits",
             Shape(1, 224), Shape(1, 64), batch_norm="spread"),
    ZooEntry("convnext_tiny", "cnn", _convnext_tiny, "ConvNextForImageClassification", "logits",
             Shape(1, 224), Shape(1, 64)),
    ZooEntry("regnet_y", "cnn", _regnet_y, "RegNetForImageClassification", "logits", Shape(1, 224), Shape(1, 64),
             batch_norm="spread"),
    ZooEntry("bit_r50", "cnn", _bit_r50, "BitForImageClassification", "logits", Shape(1, 224), Shape(1, 64),
             batch_norm="spread"),
    ZooEntry("levit_128s", "cnn", _levit_128s, "LevitForImageClassification", "logits", Shape(1, 224),
             Shape(1, 64), batch_norm="spread"),
    ZooEntry("poolformer_s12", "cnn", _poolformer_s12, "PoolFormerForImageClassification", "logits",
             Shape(1, 224), Shape(1, 64), batch_norm="spread"),
    ZooEntry("mobilenet_v3_large", "cnn", _mobilenet_v3_large, "mobilenet_v3_large", None, Shape(1, 224),
             Shape(1, 64), batch_norm="measured", library="torchvision"),
    ZooEntry("mixnet_s", "cnn", _mixnet_s, "mixnet_s", None, Shape(1, 224), Shape(1, 32), batch_norm="measured",
             library="timm", trim_tiny=_first_block_of_each_stage),
    ZooEntry("vit_s16", "cnn", _vit_s16, "ViTForImageClassification", "logits", Shape(1, 224), Shape(1, 32)),
    ZooEntry("swin_t", "cnn", _swin_t, "SwinForImageClassification", "logits", Shape(1, 224), Shape(1, 32)),
    ZooEntry("clip_vit_b32", "cnn", _clip_vit_b32, "CLIPVisionModel", "last_hidden_state", Shape(1, 224),
             Shape(1, 32)),
    ZooEntry("cait_xxs24", "cnn", _cait_xxs24, "cait_xxs24_224", None, Shape(1, 224), Shape(1, 64), library="timm"),
    ZooEntry("efficientvit_b0", "cnn", _efficientvit_b0, "efficientvit_b0", None, Shape(1, 224), Shape(1, 64),
             batch_norm="measured", library="timm"),
    ZooEntry("bert", "transformer", _bert, "BertModel", "last_hidden_state", Shape(1, 128), Shape(2, 16)),
    ZooEntry("distilbert", "transformer", _distilbert, "DistilBertModel", "last_hidden_state",
             Shape(1, 128), Shape(2, 16)),
    ZooEntry("gpt2", "transformer", _gpt2, "GPT2Model", "last_hidden_state", Shape(1, 64), Shape(2, 16)),
    ZooEntry("llama", "transformer", _llama, "LlamaModel", "last_hidden_state", Shape(1, 128), Shape(2, 16)),
    ZooEntry("qwen3_moe", "transformer", _qwen3_moe, "Qwen3MoeModel", "last_hidden_state", Shape(1, 128),
             Shape(2, 16)),
    ZooEntry("deberta_v2", "transformer", _deberta_v2, "DebertaV2Model", "last_hidden_state", Shape(1, 128),
             Shape(2, 16)),
    ZooEntry("gemma2", "transformer", _gemma2, "Gemma2Model", "last_hidden_state", Shape(1, 128), Shape(2, 16)),
    ZooEntry("t5_encoder", "transformer", _t5_encoder, "T5EncoderModel", "last_hidden_state",
             Shape(1, 128), Shape(2, 16)),
    ZooEntry("wav2vec2", "audio", _wav2vec2, "Wav2Vec2Model", "last_hidden_state", Shape(1, 16000), Shape(1, 800)),
]}


def entry(name: str) -> ZooEntry:
    """The zoo entry called `name`, or OptionError listing the zoo."""
    if name not in ZOO:
        raise OptionError(f"unknown zoo model {name!r}; the zoo has {list(ZOO)}")
    return ZOO[name]


def torch_module(name: str, tiny: bool = False, seed: int = 0, exportable: bool = False):
    """The zoo model as an eval-mode torch.nn.Module taking example_inputs' arrays and returning one tensor;
    `exportable` gives a mixture of experts the experts implementation the ONNX exporters translate."""
    spec = entry(name)
    torch.manual_seed(seed)
    if spec.library == "torchvision":
        model = torchvision.models.get_model(spec.model_class, **spec.config(tiny))
    elif spec.library == "timm":
        model = timm.create_model(spec.model_class, pretrained=False, **spec.config(tiny))
    else:
        model = getattr(hf, spec.model_class)(spec.config(tiny))
    if tiny and spec.trim_tiny is not None:
        spec.trim_tiny(model)
    if exportable and spec.library == "transformers":  # read by experts layers only; their eager and grouped_mm
        model.config._experts_implementation = "batched_mm"  # implementations do not export to ONNX
    if spec.batch_norm:
        _trained_looking(model)
    module = SingleOutput(model, spec)
    if spec.batch_norm == "measured":
        _measured_statistics(module, spec.tiny if tiny else spec.full, seed)
    return module.eval()


@torch.no_grad()
def _trained_looking(model: torch.nn.Module) -> None:
    """Fan-in scaled conv and linear weights and spread-out batch-norm statistics, as a trained CNN has.

    With HF's init (weights N(0, 0.02), unit batch norms) a deep CNN's activations vanish: EfficientNet's
    logits come out exactly zero, and nothing can be compared against them.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d | torch.nn.Linear):
            fan_in = module.weight[0].numel()
            module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5)
        elif isinstance(module, torch.nn.BatchNorm2d):
            module.weight.uniform_(0.5, 1.5)
            module.bias.normal_(0.0, 0.1)
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 1.5)


@torch.no_grad()
def _measured_statistics(module: torch.nn.Module, shape: Shape, seed: int, batches: int = 4) -> None:
    """Batch-norm statistics measured over seeded random images, as training leaves them matched to the data.

    With spread random statistics, MobileNetV3's activations grow to 2e3 through its hardswish blocks and 0.1% of
    input noise moves its logits by 24% (bf16 by 40%): no precision could be judged on it. Measured, 0.8%.
    """
    momenta = {norm: norm.momentum for norm in module.modules() if isinstance(norm, torch.nn.BatchNorm2d)}
    for norm in momenta:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the batches
    generator = torch.Generator().manual_seed(seed + 1)
    module.train()
    for _ in range(batches):
        module(torch.randn(8, 3, shape.size, shape.size, generator=generator))
    for norm, momentum in momenta.items():
        norm.momentum = momentum


def example_inputs(name: str, tiny: bool = False, seed: int = 0) -> list[np.ndarray]:
    """Seeded inputs: normalized images for CNNs; token ids (and an all-ones attention mask) for transformers; a
    normalized waveform for audio models."""
    spec = entry(name)
    shape = spec.tiny if tiny else spec.full
    rng = np.random.default_rng(seed)
    if spec.kind == "cnn":
        return [rng.standard_normal((shape.batch, 3, shape.size, shape.size)).astype("float32")]
    if spec.kind == "audio":
        return [rng.standard_normal((shape.batch, shape.size)).astype("float32")]
    ids = rng.integers(0, spec.config(tiny).vocab_size, (shape.batch, shape.size)).astype("int64")
    return [ids, np.ones_like(ids)]


class SingleOutput(torch.nn.Module):
    """A zoo model called with positional arrays, returning its one chosen output."""

    def __init__(self, model: torch.nn.Module, spec: ZooEntry):
        super().__init__()
        self.model = model
        self.input_names = INPUT_NAMES[spec.kind]
        self.output = spec.output

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The model's chosen output for positional inputs (images; token ids and a mask; a waveform)."""
        if self.output is None:
            return self.model(*inputs)
        return getattr(self.model(**dict(zip(self.input_names, inputs))), self.output)


def export_onnx(name: str, path: "str | Path", tiny: bool = False, exporter: str = "torchscript",
                dynamic: bool = False) -> Path:
    """Write the zoo model to an ONNX file with torch.onnx.export's TorchScript or dynamo exporter; `dynamic` marks
    the batch axis (and a transformer's sequence axis) dynamic, as exports meant for serving do (DYNAMIC_AXES)."""
    if exporter not in EXPORTERS[:2]:
        raise OptionError(f"ONNX exporter must be one of {list(EXPORTERS[:2])}, got {exporter!r}")
    if dynamic and exporter != "torchscript":
        raise OptionError("dynamic axes take the torchscript exporter (the dynamo one wants torch.export's "
                          "dynamic_shapes, which these models' shape checks refuse)")
    module = torch_module(name, tiny, exportable=True)
    inputs = tuple(torch.from_numpy(x) for x in example_inputs(name, tiny))
    names = module.input_names[:len(inputs)]
    axes = dict.fromkeys(names, DYNAMIC_AXES[entry(name).kind]) if dynamic else None
    with torch.no_grad():
        torch.onnx.export(module, inputs, str(path), input_names=names, output_names=["output"], dynamic_axes=axes,
                          opset_version=OPSET if exporter == "torchscript" else None,
                          dynamo=exporter == "dynamo", external_data=False)
    return Path(path)


def load(name: str, tiny: bool = False, exporter: str = "torchscript") -> tvm.IRModule:
    """The zoo model as a Relax module, exported with `exporter` (see EXPORTERS) and imported by relay_amp."""
    if exporter not in EXPORTERS:
        raise OptionError(f"exporter must be one of {list(EXPORTERS)}, got {exporter!r}")
    if exporter == "torch.export":  # transformers' default experts (grouped_mm) too, as users export them
        return frontend.from_torch(torch_module(name, tiny), example_inputs(name, tiny))
    with tempfile.TemporaryDirectory() as tmp:
        return frontend.from_onnx(export_onnx(name, Path(tmp) / f"{name}.onnx", tiny, exporter))
