"""Whether a checkpoint can be trusted: the integrity gate every data-reading command runs
first (integrity; integrity_small in pure Python), SHA-256 manifests (manifest) and what
transformers expects of an export (expected_keys)."""
