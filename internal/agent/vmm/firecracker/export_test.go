package firecracker

// RemoveInJail and ExistsInJail are the jail's file operations, for the attack tests.
var (
	RemoveInJail = removeInJail
	ExistsInJail = existsInJail
)
