"""The one name -> entry registry every kind of plugin uses.

    TOOLS = Registry("tool")

    @TOOLS.register("search")            # or TOOLS.add("search", entry, origin=fn)
    def search(query: str) -> str: ...

    TOOLS.get("serch")   # ValueError: unknown tool 'serch'; did you mean 'search'? registered tool names: [...]

One set of rules for all of them (loss kernels, engine kinds, environments, tools, rewards, workloads,
built-in tasks, recipes):
- a name (or alias) registered twice is refused, naming the registry, the entry holding the name and
  the registered names; with `user_may_replace_builtins` (the loss kernels) a user module may replace a
  *built-in* entry instead, with a `UserWarning` naming both, and `unregister` restores the built-in;
  with `same_entry_again_is_noop` (workloads) registering the very same entry again is a no-op (a
  module imported twice);
- an unknown name is answered with the close matches and the registered names;
- lookups (`get`, `all_names`) first import the built-in kernel modules and `stacx/custom/`
  (`stacx.plugins.discovery`), so a name is found whichever module was imported first (`get` does not
  where `discovers=False`: built-in tasks, looked up on light paths);
- a user entry's module is recorded so that it is shipped to the Ray role workers (unless only the
  driver runs the kind: rewards, built-in tasks).

A `Registry` reads like a mapping of the names registered so far (`in`, `[name]`, `items()`, `len`),
without discovery; `get(name)` is the checked lookup.
"""

from __future__ import annotations

import difflib
import importlib
import warnings
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

from stacx.plugins.discovery import import_builtin_and_custom_modules, record_user_module

E = TypeVar("E")
F = TypeVar("F")
_MISSING = object()


def is_builtin_entry(entry: object) -> bool:
    """True for an entry defined inside the `stacx` package, except user files in `stacx/custom/`."""
    module = getattr(entry, "__module__", None) or ""
    return module.startswith("stacx.") and not module.startswith("stacx.custom")


class ImportedOnCall:
    """A callable named 'package.module:attribute', imported at its first call: a registration that must
    not import the module it names (the core's `text` workload names the trainer's driver this way)."""

    def __init__(self, spec: str):
        module, _, attribute = spec.partition(":")
        if not module or not attribute:
            raise ValueError(f"ImportedOnCall({spec!r}): expected 'package.module:attribute'")
        self.spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, attribute = self.spec.partition(":")
        return getattr(importlib.import_module(module), attribute)(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImportedOnCall) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"ImportedOnCall({self.spec!r})"


def describe_entry(entry: object) -> str:
    """`module.qualname` of a function or class (what an error message names)."""
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


class Registry(Generic[E]):
    """One kind of plugin: names (and aliases) to entries, with per-name traits (module doc)."""

    def __init__(self, kind: str, *, entries_are_callable: bool = True, user_may_replace_builtins: bool = False,
                 same_entry_again_is_noop: bool = False, default_traits: Any = None,
                 ships_user_modules: bool = True, discovers: bool = True, known_as: Optional[str] = None,
                 error: type[ValueError] = ValueError):
        """kind: what one entry is, as messages name it ('policy loss', 'engine kind'). known_as: how the
        list of names is introduced in messages ('known tasks'; default 'registered <kind> names'). error:
        the ValueError subclass a refusal raises (`RecipeError` for recipes). ships_user_modules: a user
        entry's module is shipped to the Ray role workers (False for plugins only the driver runs: rewards).
        discovers: `get` imports the built-in and custom modules first (False: a registry filled by its own
        module, looked up on light paths that must not import the kernels: built-in tasks)."""
        self.kind = kind
        self.entries_are_callable = entries_are_callable
        self.user_may_replace_builtins = user_may_replace_builtins
        self.same_entry_again_is_noop = same_entry_again_is_noop
        self.ships_user_modules = ships_user_modules
        self.discovers = discovers
        self.default_traits = default_traits
        self.known_as = known_as
        self.error = error
        self._entries: dict[str, E] = {}
        self._origins: dict[str, object] = {}
        """name -> the object whose module defines the entry (the entry itself unless `add` was told)."""
        self._traits: dict[str, Any] = {}
        self._replaced_builtins: dict[str, tuple[E, Any, object]] = {}
        """name -> the built-in (its traits, its origin) a user registration replaced (restored by `unregister`)."""

    # ---- registering ----------------------------------------------------------------------------

    def register(self, name: str, *, aliases: Iterable[str] = (), traits: Any = None) -> Callable[[F], F]:
        """Decorator registering the decorated object under `name` (and `aliases`) with `traits`
        (default: the registry's `default_traits`); returns the object unchanged."""
        names = self._checked_names(name, aliases)

        def decorator(entry: F) -> F:
            self._add(names, entry, traits, origin=entry)
            return entry

        return decorator

    def add(self, name: str, entry: E, *, aliases: Iterable[str] = (), traits: Any = None,
            origin: object = None) -> E:
        """Register `entry` under `name` (and `aliases`); `origin`: the function or class whose module
        defines it (default: the entry), which says whether it is built in and which user module to ship."""
        self._add(self._checked_names(name, aliases), entry, traits, origin=entry if origin is None else origin)
        return entry

    def _checked_names(self, name: str, aliases: Iterable[str]) -> list[str]:
        names = [name, *aliases]
        for each in names:
            if not isinstance(each, str) or not each:
                raise self.error(f"{self.kind} name must be a non-empty string, got {each!r}")
        return names

    def _add(self, names: list[str], entry: Any, traits: Any, *, origin: object) -> None:
        if self.entries_are_callable and not callable(entry):
            raise self.error(f"{self.kind} {names[0]!r}: registered object {entry!r} is not callable")
        if self.same_entry_again_is_noop and all(self._entries.get(each, _MISSING) == entry for each in names):
            return
        replaced = {}
        for each in names:
            if each not in self._entries:
                continue
            holder = self._origins[each]
            if self.user_may_replace_builtins and is_builtin_entry(holder) and not is_builtin_entry(origin):
                replaced[each] = self._entries[each]
                continue
            raise self.error(f"{self.kind} {each!r} is already registered (by {describe_entry(holder)}); "
                             f"{self._listing()}")
        for each, builtin in replaced.items():
            warnings.warn(
                f"{self.kind} {each!r}: {describe_entry(origin)} replaces the built-in "
                f"{describe_entry(self._origins[each])} in this process; choose another name to keep both",
                UserWarning, stacklevel=3,
            )
            self._replaced_builtins[each] = (builtin, self._traits[each], self._origins[each])
        for each in names:
            self._entries[each] = entry
            self._traits[each] = traits if traits is not None else self.default_traits
            self._origins[each] = origin
        if self.ships_user_modules and not is_builtin_entry(origin):
            record_user_module(getattr(origin, "__module__", None))  # a user plugin reaches the Ray workers too

    def unregister(self, name: str) -> None:
        """Remove a name (tests and interactive sessions that redefine an entry); a built-in a user entry
        replaced gets its name back."""
        if name not in self._entries:
            raise self.error(f"unknown {self.kind} {name!r}; {self._listing()}")
        del self._entries[name], self._traits[name], self._origins[name]
        if name in self._replaced_builtins:
            self._entries[name], self._traits[name], self._origins[name] = self._replaced_builtins.pop(name)

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        """Remove and return `name`'s entry (`default` when absent), like `dict.pop`."""
        if name not in self._entries:
            if default is _MISSING:
                raise KeyError(name)
            return default
        entry = self._entries[name]
        self.unregister(name)
        return entry

    # ---- looking up -----------------------------------------------------------------------------

    def get(self, name: str) -> E:
        """The entry registered under `name`, the built-in and custom modules imported first; an unknown
        name raises (the registry's `error`) with the close matches and the registered names."""
        if self.discovers:
            import_builtin_and_custom_modules()  # once per process: a stacx/custom/ file may replace a built-in
        if name not in self._entries:
            raise self.error(self.unknown_name_message(name))
        return self._entries[name]

    def unknown_name_message(self, name: str) -> str:
        """'unknown <kind> <name>; did you mean ...? <the registered names>'."""
        return f"unknown {self.kind} {name!r}; {self.close_match_hint(name)}{self._listing()}"

    def close_match_hint(self, name: str) -> str:
        """"did you mean 'x'? " for the registered name closest to a mistyped `name` ('' when none is)."""
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        return f"did you mean {close[0]!r}? " if close else ""

    def _listing(self) -> str:
        if self.known_as is None:
            return f"registered {self.kind} names: {self.names()}"
        return f"{self.known_as}: {', '.join(self.names()) or 'none'}"

    def traits(self, name: str) -> Any:
        """The traits `name` was registered with (looked up like `get`)."""
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        """The names registered so far, sorted (no discovery)."""
        return sorted(self._entries)

    def all_names(self) -> list[str]:
        """`names()` once the built-in and custom modules have registered theirs."""
        import_builtin_and_custom_modules()
        return self.names()

    # ---- the mapping of the names registered so far -------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> E:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, E]]:
        return list(self._entries.items())

    def values(self) -> list[E]:
        return list(self._entries.values())

    def keys(self) -> list[str]:
        return list(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
