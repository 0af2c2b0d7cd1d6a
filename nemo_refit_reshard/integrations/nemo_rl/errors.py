"""The one error NeMo RL config checks raise."""


class NemoRlConfigError(ValueError):
    """A NeMo RL config value the refit cannot use; one line naming key, value, choices."""


__all__ = ["NemoRlConfigError"]
