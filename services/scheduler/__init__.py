"""scheduler: knows every engine endpoint and its load; feeds gateways."""
