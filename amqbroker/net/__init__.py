"""trio I/O: listeners, one driver per connection. The only place bytes meet a socket."""
