"""SnapKV (Li et al., NeurIPS 2024): the keys a prompt's last queries attend to, chosen once after the prefill; every
later query searches that fixed set. The lab's static selection against its query-time retrievers."""

from anns_lab_snapkv.snapkv import SnapKV

__all__ = ["SnapKV"]
