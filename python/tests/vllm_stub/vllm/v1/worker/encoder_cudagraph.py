"""The encoder CUDA-graph manager as vLLM's (budget graphs): per token budget, the model's capture inputs on
dummy grids, one eager forward, then the capture; for a real batch: the smallest fitting budget, the model's
replay values zeroed + slice-copied (or the model's padding_logics) into the captured buffers, 0-d ones
copied, graph.replay() (no Python of the model runs), the output buffer's first tokens returned."""
from dataclasses import dataclass

import torch

from vllm.config import get_current_vllm_config


@dataclass
class BudgetGraphMetadata:
    token_budget: int
    max_batch_size: int
    graph: object
    input_buffers: dict
    output_buffer: object


class EncoderCudaGraphManager:
    def __init__(self, model, token_budgets, max_batch_size, device=None, dtype=torch.bfloat16, vllm_config=None):
        cfg = vllm_config if vllm_config is not None else get_current_vllm_config()
        if not cfg.compilation_config.cudagraph_mm_encoder:
            raise ValueError("EncoderCudaGraphManager needs compilation_config.cudagraph_mm_encoder")
        self.model, self.dtype = model, dtype
        self.device = device if device is not None else torch.device("cuda")
        self.token_budgets = sorted(token_budgets)
        self.max_batch_size = max_batch_size
        if max_batch_size > self.token_budgets[0]:
            raise ValueError("max_batch_size must be <= the smallest token budget")
        self.budget_graphs = {}
        self.graph_pool = None
        self.graph_hits = self.graph_misses = 0

    @staticmethod
    def _copy_padded_buffer(dst, src):
        dst.zero_()
        dst[: src.shape[0]].copy_(src)

    def capture(self, graph_pool=None):
        self.graph_pool = graph_pool if graph_pool is not None else torch.cuda.graph_pool_handle()
        for budget in sorted(self.token_budgets, reverse=True):
            self._capture_budget_graph(budget)

    def _capture_budget_graph(self, budget):
        values = self.model.prepare_encoder_cudagraph_capture_inputs(budget, self.max_batch_size, self.device,
                                                                      self.dtype)
        with torch.inference_mode():
            output = self.model.encoder_cudagraph_forward({**values})
            output_buffer = torch.empty_like(output)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.graph_pool):
            output = self.model.encoder_cudagraph_forward({**values})
            output_buffer.copy_(output)
        self.budget_graphs[budget] = BudgetGraphMetadata(budget, self.max_batch_size, graph, values, output_buffer)

    def _find_budget(self, tokens):
        return next((b for b in self.token_budgets if b >= tokens), None)

    def execute(self, pixel_values, grid_thw):
        """The encoder's output [tokens, hidden] for one batch (replayed where a budget fits, else eager)."""
        tokens = int(pixel_values.shape[0])
        budget = self._find_budget(tokens)
        if budget is None or budget not in self.budget_graphs or len(grid_thw) > self.max_batch_size:
            self.graph_misses += 1
            with torch.inference_mode():
                return self.model(pixel_values, grid_thw)
        meta = self.budget_graphs[budget]
        replay = self.model.prepare_encoder_cudagraph_replay_buffers(pixel_values, grid_thw, self.max_batch_size,
                                                                     budget)
        logics = getattr(self.model, "padding_logics", {})
        with torch.inference_mode():
            for key, buf in meta.input_buffers.items():
                src = replay.get(key)
                if src is None:
                    continue
                if src.ndim == 0:
                    buf.copy_(src)
                else:
                    logics.get(key, self._copy_padded_buffer)(buf, src)
            meta.graph.replay()
        self.graph_hits += 1
        return meta.output_buffer[:tokens].clone()
