"""InfLLM (Xiao et al., NeurIPS 2024): the context as blocks of consecutive keys, each represented by the few keys the
queries right after it attended most; a query reads the blocks whose representatives it scores highest. The paper's
other baseline beside SnapKV: block-level retrieval from the context's own attention."""

from anns_lab_infllm.infllm import InfLLM

__all__ = ["InfLLM"]
