"""The router (`pdfleet router`): the OpenAI endpoint clients call, in front of prefill/decode or colocated workers.
Imports no torch."""
