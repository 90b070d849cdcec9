"""Masks: the MaskLayer module and finding masks in a model."""

from fisherprune.masks.find import MaskSet, as_mask_dict, find_masks, masks_kept
from fisherprune.masks.layer import MaskLayer

__all__ = ["MaskLayer", "MaskSet", "as_mask_dict", "find_masks", "masks_kept"]
