"""rlcore-npu: Ascend NPU platform and MindSpeed compatibility for routing replay."""
