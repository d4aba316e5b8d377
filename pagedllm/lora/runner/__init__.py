"""LoRA's runner side: resident adapters loaded into the model's slots."""
