"""What both scripts load: the model, a head file and the cached features of its predictors'
corpus (the held-out split is the test split)."""
from dataclasses import dataclass

import torch

import selfspec
from selfspec.heads import load_heads
from selfspec.heads.files import find_head_file
from selfspec.heads.modules import output_layer
from selfspec.training.drafter import drafter_positions
from selfspec.training.pipeline import DataRequest, StageTimes, draft_rows as _draft_rows, in_feature_order, prepare_features

DATA = "stdlib*4,onpolicy:humaneval,onpolicy:stdlib,onpolicy:gsm*2"


@dataclass
class Setup:
    eng: object
    ex: object
    heads: object
    target: object
    features: object
    positions: object
    rows: torch.Tensor        # the 4,096-token draft vocabulary's rows
    out: object
    embedding: torch.Tensor


def load(model: str, heads: str, max_new_tokens: int, layers: list[int]) -> Setup:
    torch.set_num_threads(2)
    eng = selfspec.load(model, dtype="bf16", show_progress=False)
    target = find_head_file(heads, model)
    c = load_heads(target, eng)
    prep = prepare_features(eng, DataRequest(DATA, 49000, max_new_tokens), layers, StageTimes(),
                            progress=False)
    return Setup(eng, eng.executor, c, target, prep.features,
                 drafter_positions(in_feature_order(prep.items)),
                 _draft_rows(eng, c, target, 4096), output_layer(eng),
                 eng.executor.embed_tokens.weight)
