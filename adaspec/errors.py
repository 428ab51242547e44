"""Exceptions raised at adaspec's public boundaries; all are ValueErrors with a message that
names the bad value and what would be accepted."""


class AdaspecError(ValueError):
    """Base class of every error adaspec raises for bad input."""


class SettingsError(AdaspecError):
    """An ADASPEC_* environment variable or a settings argument is invalid."""


class GenerationArgumentError(AdaspecError):
    """A generation argument (prompt, max_tokens, sampling knob) is invalid."""


class DrafterError(AdaspecError):
    """A drafter is unknown, misconfigured, or proposed something illegal."""


class PluginError(DrafterError):
    """A plugin module (--plugin, ADASPEC_PLUGINS) cannot be imported."""


class DrafterMismatchError(DrafterError):
    """A drafter does not fit the target (vocabulary, hidden size, tap layers)."""


class TargetError(AdaspecError):
    """A target model cannot be used (e.g. its cache cannot be rolled back)."""


class ModelLoadError(AdaspecError):
    """A model path, GGUF file, catalogue entry or cache entry is missing or broken."""


class DistributedError(AdaspecError):
    """A target cannot be sharded over the ranks, or a rank lost its peers mid-generation."""
