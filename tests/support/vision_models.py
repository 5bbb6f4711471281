"""Image captioners: a vision tower whose stem convolves the image into patches, its transformer blocks, a projection
into the text width, and a text tower that reads the image features with the token embeddings (width 64, vocab 96,
8 tokens, 16×16 images in 4×4 patches: 16 image tokens). Megatron's ViT keeps the patch embedding (a convolution of
the image, the stream's start, as an embedding's lookup is) and the position table whole on every rank, cuts the
vision blocks' attention and MLP as the text's, and the projection (one linear into the text width) is computed
whole between the vision tower's last all-reduce and the text tower's first column. Every hand-written model is
``(idx, image, targets) -> (logits, loss)``, the loss over the text's positions.

- ``prepended``: GIT's way: ``nn.Conv2d`` patches ``flatten(2).transpose(1, 2)``, an ``nn.Embedding`` of the patch
  positions, the projection ``Linear`` + ``LayerNorm``, the image tokens joined before the token embeddings by
  ``torch.cat`` along the sequence;
- ``appended``: the same stem, its positions a learned ``(1, P, h)`` parameter added to the patches (a ViT's
  ``pos_embed``), the image tokens joined after the tokens, the loss read from the first tokens;
- ``pooled``: the stem ``F.conv2d`` of raw parameters, ``reshape(b, h, -1).permute(0, 2, 1)``, the positions a
  raw table read by ``table[arange]``, the patches mean-pooled and projected (no norm), the image vector added to
  every token embedding;
- ``git``: Hugging Face's GIT (``GitForCausalLM``: 2 vision and 2 text layers) on ``input_ids``, ``labels`` and
  ``pixel_values``, its image tokens prepended.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pattern_models import H, NH, HD, V

S, IMG, PATCH, CH = 8, 16, 4, 3
P = (IMG // PATCH) ** 2  # image tokens


class Attention(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, NH, HD).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (b, heads, s, d)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class Block(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention(causal)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class Vision(nn.Module):
    """Patches of the image, their positions, 2 bidirectional blocks and a final norm: ``(b, P, h)``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        g = torch.Generator().manual_seed(5)
        if kind == "pooled":
            self.patch_w = nn.Parameter(torch.randn(H, CH, PATCH, PATCH, generator=g) * 0.1)
            self.patch_b = nn.Parameter(torch.zeros(H))
            self.pos_table = nn.Parameter(torch.randn(P, H, generator=g) * 0.02)
        else:
            self.patch = nn.Conv2d(CH, H, PATCH, stride=PATCH)
            if kind == "appended":
                self.pos_embed = nn.Parameter(torch.randn(1, P, H, generator=g) * 0.02)
            else:
                self.pos = nn.Embedding(P, H)
        self.blocks = nn.ModuleList([Block(causal=False) for _ in range(2)])
        self.norm = nn.LayerNorm(H)

    def forward(self, image):
        b = image.shape[0]
        positions = torch.arange(P, device=image.device)
        if self.kind == "pooled":
            x = F.conv2d(image, self.patch_w, self.patch_b, stride=PATCH).reshape(b, H, -1).permute(0, 2, 1)
            x = x + self.pos_table[positions]
        else:
            pos = self.pos_embed if self.kind == "appended" else self.pos(positions)  # (1, P, h) or (P, h)
            x = self.patch(image).flatten(2).transpose(1, 2) + pos  # (b, P, h)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class Captioner(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.vision = Vision(kind)
        self.proj = nn.Linear(H, H)
        if kind != "pooled":
            self.proj_norm = nn.LayerNorm(H)
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(causal=True) for _ in range(2)])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx, image, targets):
        tokens = self.emb(idx)  # (b, s, h)
        feats = self.vision(image)  # (b, P, h)
        if self.kind == "pooled":
            x = tokens + self.proj(feats.mean(1)).unsqueeze(1)  # one image vector added to every token
        else:
            img = self.proj_norm(self.proj(feats))
            x = torch.cat([img, tokens], dim=1) if self.kind == "prepended" else torch.cat([tokens, img], dim=1)
        for blk in self.blocks:
            x = blk(x)
        text = x[:, P:] if self.kind == "prepended" else x[:, :S]  # (b, s, h)
        logits = self.head(self.norm(text))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


KINDS = ("prepended", "appended", "pooled", "git")


def _git():
    from transformers import AutoModelForCausalLM, GitConfig

    vision = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=NH,
                  num_channels=CH, image_size=IMG, patch_size=PATCH)
    cfg = GitConfig(vision_config=vision, vocab_size=128, hidden_size=H, intermediate_size=2 * H,
                    num_hidden_layers=2, num_attention_heads=NH, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, use_cache=False,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, S), generator=g)
    return model, (), {"input_ids": ids, "labels": ids, "pixel_values": torch.randn(2, CH, IMG, IMG, generator=g)}


def build(kind: str):
    if kind == "git":
        return _git()
    torch.manual_seed(0)
    model = Captioner(kind)
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, V, (2, S), generator=g), torch.randn(2, CH, IMG, IMG, generator=g),
            torch.randint(0, V, (2, S), generator=g))
    return model, args, {}
