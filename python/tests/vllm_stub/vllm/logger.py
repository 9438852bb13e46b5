import logging

_once = set()


class _Logger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.pop("scope", None)
        return msg, kwargs

    def info_once(self, msg, *args, **kw):
        if (msg, args) not in _once:
            _once.add((msg, args))
            self.info(msg, *args, **kw)

    def warning_once(self, msg, *args, **kw):
        if (msg, args) not in _once:
            _once.add((msg, args))
            self.warning(msg, *args, **kw)

    def debug_once(self, msg, *args, **kw):
        self.debug(msg, *args, **kw)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
