;; A WASI reactor: no _start, so it is not a command.
(module
  (memory (export "memory") 1)
  (func (export "_initialize")))
