module ssegen

go 1.19
